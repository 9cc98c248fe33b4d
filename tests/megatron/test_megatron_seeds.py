"""The seeds' shrunk workflows (examples/seeds/*_tiny.yaml) run end to end for 3 steps.

Seed 000: ROLL's Qwen3-30B-A3B recipe as a tiny Qwen3-MoE with expert parallelism over 2 ranks
(mbridge). Seed 002: Trinity-RFT's PPO with actor, reference and critic on megatron, loaded with
use_mbridge: false (the plugin's dense converter). The full-size files are validated in
tests/vllm/test_vllm_seeds.py (their rollout is vLLM).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEEDS = Path(__file__).resolve().parents[2] / "examples" / "seeds"


@pytest.mark.parametrize(
    "name",
    [
        "seed000_tiny.yaml",
        pytest.param("seed002_tiny.yaml", marks=pytest.mark.extended),
    ],
)
def test_shrunk_seed_runs_three_steps(tmp_path, posttrain_cache, name):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.cli",
            "run",
            str(SEEDS / name),
            "--set",
            f"trainer.output_dir={run_dir}",
            "--set",
            "trainer.logger=[jsonl]",
        ],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert len(steps) == 3
    assert all(0.0 <= s["reward/mean"] <= 1.0 for s in steps)
