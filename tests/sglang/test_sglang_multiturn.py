"""Multi-turn episodes on SGLang: examples/calculator_tool.yaml with sglang as actor_infer on 2
ranks.

Each episode's turns reach the engine as continuation requests (its whole context so far, token
ids, the calculator's stop string ``</call>``, one sample). What the run must show, and why it
proves tool calls, an idle rollout rank and masked tool tokens: posttrain.testing.multiturn.
90 s on this machine's 2 CPU cores shared with other work (load 7-9), 70 s of it the engines'
start-up (the 10 steps take 5 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.testing.multiturn import engine_multiturn_overrides, read_multiturn_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "calculator_tool.yaml"
# As examples/quickstart_sglang.yaml: a capped KV cache and the attention that runs on CPU.
STRATEGY_CONFIG = "{max_total_tokens: 4096, attention_backend: torch_native}"
# The contract kit's tolerance for SGLang's log-probs (tests/sglang/test_sglang_contract.py).
LOGPROB_TOLERANCE = 1e-5


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calculator_example_runs_multiturn_on_sglang(tmp_path, posttrain_cache):
    run_dir = tmp_path / "run"
    overrides = engine_multiturn_overrides(
        run_dir, "preset:tiny-qwen2-calculator", "sglang", STRATEGY_CONFIG
    )
    cmd = [sys.executable, "-m", "posttrain.cli", "run", str(EXAMPLE)]
    cmd += [x for item in overrides for x in ("--set", item)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = read_multiturn_run(run_dir, ranks=2)
    print(f"\nsglang multi-turn: {run.summary()}")
    run.check(LOGPROB_TOLERANCE)
