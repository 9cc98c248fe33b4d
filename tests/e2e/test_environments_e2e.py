"""A short run with an environment: multi-turn episodes with per-turn rewards train through
``posttrain run``, and environments that raise, hang or answer garbage score 0 without stopping
it. They run in worker processes (``isolation: process``): the hung ones are killed, every
worker is gone when the run ends, and the console has one line per step about them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import posttrain_cmd, read_metrics, run_env

CORE_TESTS = Path(__file__).resolve().parents[1] / "core"

WORKFLOW = """\
model_args: {model_name_or_path: preset:tiny-qwen2, dtype: fp32}
data: {path: data.jsonl}
plugins: [env_support]                 # tests/core/env_support.py: the broken environment
# REINFORCE++ whitens over the batch: the healthy episodes' rewards against the failed ones' 0
algorithm: {name: reinforce_plus_plus, group_size: 2, rollout_batch_size: 4}
environment:
  name: broken                         # answer 1 raises, 2 hangs, 3 answers garbage
  kwargs: {turns: 2, pid_dir: pids}    # each environment's process id, left there
  reward: turn                         # each turn's reward on its last token
  max_turns: 3
  max_total_tokens: 16
  step_timeout_s: 1
  isolation: process
  processes: 4
actor_train:
  strategy_args: {strategy_name: fsdp2_train, strategy_config: {}}
  device_mapping: [0]
  training_args: {learning_rate: 1.0e-3, per_device_train_batch_size: 8}
actor_infer:
  strategy_args: {strategy_name: hf_infer}
  device_mapping: [0]
  generating_args: {max_new_tokens: 3, temperature: 1.0}
reward: {function: exact_match}
trainer: {max_steps: 2, save_final: false, output_dir: run, logger: [jsonl], progress: false}
"""


def run_workflow(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """``posttrain run`` of WORKFLOW (``--set`` ``overrides``) in ``tmp_path``."""
    (tmp_path / "workflow.yaml").write_text(textwrap.dedent(WORKFLOW))
    (tmp_path / "pids").mkdir()
    records = [{"prompt": f"0+{a}=", "answer": str(a)} for a in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = run_env()
    env["PYTHONPATH"] = os.pathsep.join([str(CORE_TESTS), env["PYTHONPATH"]])
    sets = [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run(
        posttrain_cmd("run", str(tmp_path / "workflow.yaml"), *sets),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=110,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_with_a_broken_environment_goes_on(tmp_path, e2e_cache):
    proc = run_workflow(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # Every step holds the 4 prompts x 2 samples: those of answers 1 and 3 fail (errors),
        # those of answer 2 hang past step_timeout_s; answer 0's finish their 2 turns.
        assert (m["env/errors"], m["env/timeouts"]) == (4, 2)
        assert m["env/turns_mean"] == pytest.approx((2 * 2 + 6 * 2) / 8)
        assert m["actor/grad_norm"] > 0  # the model's tokens of the episodes trained
    lines = [line for line in proc.stderr.splitlines() if "episodes failed and score 0" in line]
    assert [line.split(": ")[1] for line in lines] == ["step 1", "step 2"], proc.stderr[-3000:]
    assert "logs/environments.log" in lines[0]
    log = (tmp_path / "run" / "logs" / "environments.log").read_text()
    assert re.search(r"step 2 prompt \d sample 1: turn 1: step\(\) did not answer within 1s", log)
    assert 'raise RuntimeError("the environment crashed")' in log  # a worker's traceback
    # Every worker process (the killed ones, their replacements, the last ones) is gone.
    pids = [int(p) for p in os.listdir(tmp_path / "pids")]
    assert len(set(pids)) >= 4
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_whose_every_episode_keeps_failing_stops(tmp_path, e2e_cache):
    proc = run_workflow(
        tmp_path,
        "environment.name=unbuildable",  # its constructor raises
        "environment.max_failed_steps=2",
        "trainer.max_steps=4",
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Step 1 is warned about and trains on nothing; step 2 stops the run, no traceback shown.
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]
    assert "step 1: 8 of 8 episodes failed" in proc.stderr and "EVERY episode" in proc.stderr
    assert (
        "error: environment 'unbuildable': every episode failed in 2 step(s) in a row "
        "(environment.max_failed_steps: 2)" in proc.stderr
    )
    assert "the constructor (Unbuildable) raised ValueError" in proc.stderr
    assert "Traceback" not in proc.stderr
    pids = [int(p) for p in os.listdir(tmp_path / "pids")]  # the worker processes
    assert len(pids) == 4 and not [p for p in pids if os.path.exists(f"/proc/{p}")]
