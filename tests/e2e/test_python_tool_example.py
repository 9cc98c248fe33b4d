"""examples/python_tool.yaml learns to run code on this CPU: GRPO over multi-turn episodes with
the python_sandbox environment (real Python in the real sandbox) raises the reward and the
tool-call rate."""

from __future__ import annotations

import pytest
from conftest import REPO, early_late, run_example_steps

EXAMPLE = REPO / "examples" / "python_tool.yaml"
# 8 prompts x 8 samples, half the example's step: each call is a sandboxed process (~16 ms of
# CPU), and the rollout's calls are most of a step's time. 15 such steps and the preset's build
# (~40 s: the warm start) stay within the test's CI budget.
STEPS = 15
PROMPTS = 8


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_python_tool_example_learns_to_run_code(tmp_path, e2e_cache):
    sets = {"algorithm.rollout_batch_size": PROMPTS}
    metrics = run_example_steps(EXAMPLE, tmp_path / "python_tool", STEPS, sets)
    reward, calls = early_late(metrics, "reward/mean"), early_late(metrics, "env/tool_call_rate")
    # The warm start calls the tool in about 1 answer of 4 and is right almost only then
    # (benchmarks/calculator_preset.py --preset tiny-qwen2-python: 0.23 calls, 0.85 right with
    # the tool, 0.000 without). Measured with this test's settings over seeds 42 (the
    # example's), 1, 2, 3, 4: the first 3 steps' reward 0.19-0.23 and call rate 0.26-0.32; the
    # last 5 steps' reward 0.42-0.50 and call rate 0.68-0.82; rises of 0.22-0.30 (reward) and
    # 0.36-0.56 (calls). Each bound leaves a margin of 0.07-0.13 below the worst seed; a reward
    # above 0.35 is out of reach without the tool.
    assert reward.first < 0.3
    assert reward.last > 0.35
    assert reward.last > reward.first + 0.12
    assert calls.last > 0.55
    assert calls.last > calls.first + 0.25
