"""examples/quickstart_deepspeed.yaml (deepspeed_train ZeRO-2 + hf_infer, hybrid layout) learns
single-digit addition: the first 150 of its 400 GRPO steps, with real DeepSpeed over gloo on 2 CPU
ranks, reach a last-10 reward of at least 0.8."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / "examples" / "quickstart_deepspeed.yaml"
# The example's first 150 of 400 steps (40% of its time) show it learning; the README quotes
# this test's setting and threshold. Last-10 reward on 2 CPU ranks (2026-11-28), seed 42 (this
# test's): 0.046 over the first 5 steps, 0.930 at step 150, 0.994 at step 400 (last-50 0.992);
# seed 7: 0.836 at step 150, 0.952 at step 400. The example trains on the quickstart's 44 train
# problems (examples/quickstart.yaml's split). On all 55 sums, as before, its step-400 figure
# moved with float-level changes alone (0.896 when written, 0.770 in issue 44, 0.865 with
# logprob_chunk_tokens 0): where one run ended there was luck, not a floor to test against.
STEPS = 150
LAST10_AT_LEAST = 0.8


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_deepspeed_learns_addition(tmp_path, posttrain_cache):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.cli",
            "run",
            str(WORKFLOW),
            "--set",
            f"trainer.output_dir={run_dir}",
            "--set",
            "trainer.resume=never",
            "--set",
            "trainer.logger=[jsonl]",
            "--set",
            f"trainer.max_steps={STEPS}",
            "--set",
            f"trainer.save_steps={STEPS}",
        ],
        capture_output=True,
        text=True,
        timeout=880,
    )
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Hybrid layout: the trainer and both hf_infer roles live in the same 2 rank processes.
    plan = (
        "actor_train (deepspeed_train) + actor_infer (hf_infer) + reference (hf_infer): "
        "2 rank processes, shared"
    )
    assert plan in proc.stdout + proc.stderr, proc.stdout[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    rewards = [m["reward/mean"] for m in metrics]
    last = sum(rewards[-10:]) / 10
    print(f"\nquickstart_deepspeed: {len(rewards)} steps in {wall:.0f}s, last-10 reward {last:.3f}")
    assert len(rewards) == STEPS
    assert sum(rewards[:5]) / 5 < 0.2, "the tiny model should start near chance"
    assert last >= LAST10_AT_LEAST
    # The held-out problems (examples/quickstart.yaml's evaluation) are scored every 50 steps.
    evaluated = [m["step"] for m in metrics if "val/heldout/reward_mean" in m]
    assert evaluated == [50, 100, 150], evaluated
    manifest = json.loads((run_dir / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    assert manifest["step"] == STEPS
    assert manifest["roles"]["actor_train"]["layout"]["zero_stage"] == 2
