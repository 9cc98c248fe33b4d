"""examples/python_tool.yaml learns to run code on this CPU: GRPO over multi-turn episodes with
the python_sandbox environment (real Python in the real sandbox) raises the reward and the
tool-call rate."""

from __future__ import annotations

import statistics

import pytest
from conftest import REPO, read_metrics, run_quickstart

EXAMPLE = REPO / "examples" / "python_tool.yaml"
# 8 prompts x 8 samples, half the example's step: each call is a sandboxed process (~16 ms of
# CPU), and the rollout's calls are most of a step's time. 15 such steps and the preset's build
# (~40 s: the warm start) stay within the test's CI budget.
STEPS = 15
PROMPTS = 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_python_tool_example_learns_to_run_code(tmp_path, e2e_cache):
    run_dir = tmp_path / "python_tool"
    sets = {
        "trainer.max_steps": STEPS,
        "algorithm.rollout_batch_size": PROMPTS,
        "trainer.logger": "[jsonl]",
    }
    overrides = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    run_quickstart(run_dir, *overrides, workflow=EXAMPLE, timeout=600)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))

    def mean(key, steps):
        return statistics.mean(m[key] for m in steps)

    first, last = metrics[:3], metrics[-5:]
    # The warm start calls the tool in about 1 answer of 4 and is right almost only then
    # (benchmarks/calculator_preset.py --preset tiny-qwen2-python: 0.23 calls, 0.85 right with
    # the tool, 0.000 without). Measured with this test's settings over seeds 42 (the
    # example's), 1, 2, 3, 4: the first 3 steps' reward 0.19-0.23 and call rate 0.26-0.32; the
    # last 5 steps' reward 0.42-0.50 and call rate 0.68-0.82; rises of 0.22-0.30 (reward) and
    # 0.36-0.56 (calls). Each bound leaves a margin of 0.07-0.13 below the worst seed; a reward
    # above 0.35 is out of reach without the tool.
    assert mean("reward/mean", first) < 0.3
    assert mean("reward/mean", last) > 0.35
    assert mean("reward/mean", last) > mean("reward/mean", first) + 0.12
    assert mean("env/tool_call_rate", last) > 0.55
    assert mean("env/tool_call_rate", last) > mean("env/tool_call_rate", first) + 0.25
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in metrics)
    assert (run_dir / "curves.png").exists()
