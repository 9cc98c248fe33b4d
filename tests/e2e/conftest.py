"""Helpers for end-to-end runs of ``posttrain run`` as a separate process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def posttrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", *args]


def run_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.update(extra)
    return env


def small_run(max_steps: int, save_steps: int) -> tuple[str, ...]:
    """``--set`` overrides for a short quickstart (8 prompts x 4 samples) that resumes."""
    overrides = {
        "trainer.max_steps": max_steps,
        "trainer.save_steps": save_steps,
        "algorithm.rollout_batch_size": 8,
        "algorithm.group_size": 4,
        "trainer.logger": "[jsonl]",
        "trainer.resume": "auto",
    }
    return tuple(arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}"))


def run_quickstart(
    run_dir: Path,
    *overrides: str,
    env=None,
    check=True,
    timeout: float = 300,
    workflow: Path = QUICKSTART,
) -> subprocess.CompletedProcess:
    """``posttrain run examples/quickstart.yaml`` (or ``workflow``) into ``run_dir`` with
    ``--set`` overrides."""
    proc = subprocess.run(
        posttrain_cmd("run", str(workflow), "--set", f"trainer.output_dir={run_dir}", *overrides),
        capture_output=True,
        text=True,
        env=env or run_env(),
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def e2e_cache(posttrain_cache):
    return posttrain_cache
