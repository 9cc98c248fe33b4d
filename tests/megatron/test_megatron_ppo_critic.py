"""PPO (GAE) on the addition task with a megatron_train critic at TP2 beside an fsdp2_train actor
and hf_infer rollout (examples/quickstart_ppo.yaml with the critic swapped): it learns, and the
critic's values follow the returns.

80 steps, about 55-70 s on 2 CPU cores (a third of it starting the shared rank processes).
Measured (seed 42, the example's critic at 1e-3): the mean reward of steps 1-10 is 0.05, of steps
71-80 0.508; the critic's mean value over steps 71-80 is 0.505, 0.040 from the mean return on
average. The fsdp2_train critic gives
the same curve to two decimals, step by step, over 100 steps (both critics start at V = 0 from
the policy's weights). The thresholds (reward >= 0.25, values >= 0.2 and within 0.1 of the
returns) leave room for run-to-run noise and still fail a critic whose head stays at zero (PPO
still learns then, as REINFORCE with whitened returns, but its values stay 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "examples" / "quickstart_ppo.yaml"
STEPS = 80


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_with_megatron_critic_learns_addition(tmp_path, posttrain_cache):
    run_dir = tmp_path / "run"
    overrides = {
        "critic.strategy_args.strategy_name": "megatron_train",
        "critic.strategy_args.strategy_config": "{tensor_model_parallel_size: 2}",
        "trainer.output_dir": str(run_dir),
        "trainer.resume": "never",
        "trainer.logger": "[jsonl]",
        "trainer.max_steps": str(STEPS),
        "trainer.save_steps": str(STEPS),
        # The full example's schedule (400 steps x 2 mini-batches): its first 80 steps.
        "actor_train.training_args.max_steps": "800",
    }
    command = [sys.executable, "-m", "posttrain.cli", "run", str(WORKFLOW)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=580)
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    last = steps[-10:]
    reward = _mean(s["reward/mean"] for s in last)
    values = _mean(s["critic/values_mean"] for s in last)
    gap = _mean(abs(s["critic/values_mean"] - s["critic/returns_mean"]) for s in last)
    print(
        f"\nppo + megatron critic: {len(steps)} steps in {wall:.0f}s, last-10 reward "
        f"{reward:.3f}, values {values:.3f} (gap to returns {gap:.3f})"
    )
    assert len(steps) == STEPS
    assert _mean(s["reward/mean"] for s in steps[:5]) < 0.2, "the tiny model starts near chance"
    assert steps[0]["critic/values_mean"] == 0.0  # the head starts at zero
    assert reward >= 0.25
    assert values >= 0.2
    assert gap <= 0.1
    assert all("critic/grad_norm" in s for s in steps)
    manifest = json.loads((run_dir / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    critic = manifest["roles"]["critic"]
    assert critic["strategy"] == "megatron_train"
    assert critic["layout"]["tensor_model_parallel_size"] == 2
    assert critic["layout"]["has_optimizer"]
