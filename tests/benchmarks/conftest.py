"""Running a benchmark script (benchmarks/*.py) as a user does: a subprocess of this Python,
in a fresh directory, its output returned for the test to check."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run_benchmark(tmp_path, posttrain_cache) -> Callable[..., str]:
    """``run_benchmark(script, *args, python=sys.executable, timeout=...)``: run
    ``benchmarks/<script>`` in ``tmp_path`` (the session's preset cache shared through
    POSTTRAIN_CACHE), assert that it exits 0, and return its stdout."""

    def run(script: str, *args: str, python: str = sys.executable, timeout: float = 120) -> str:
        proc = subprocess.run(
            [python, str(BENCHMARKS / script), *args],
            cwd=tmp_path,
            env={**os.environ, "POSTTRAIN_CACHE": posttrain_cache},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, (
            f"{script} {' '.join(args)} exited {proc.returncode}:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
        return proc.stdout

    return run
