"""benchmarks/vllm_rollout.py in its smallest setting (preset:small-qwen2, the in-process engine,
2 prompts, 1 sample of 2 tokens, one repeat), so that an API change that breaks the benchmark
fails here. tests/benchmarks/test_benchmarks_smoke.py covers the other benchmarks; this one
needs vLLM from its first step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_rollout.py"


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(330)
def test_vllm_rollout_benchmark_prints_its_table(tmp_path, posttrain_cache):
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT), "--prompts", "2", "--n", "1", "--max-new-tokens", "2",
            "--repeats", "1", "--skip-100m", "--skip-mp",
        ],
        cwd=tmp_path,
        env={**os.environ, "POSTTRAIN_CACHE": posttrain_cache},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, row = (
        line for line in proc.stdout.splitlines() if line.startswith(("| model", "| small-qwen2"))
    )
    assert "plugin tok/s" in header and "sync s" in header
    assert "in-process" in row
