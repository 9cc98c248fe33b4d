"""A run whose plugin, reward function and environment are modules next to its workflow file,
started from another directory: the driver, the rank processes and the reward pool's worker
processes all import them (tests/core/test_references.py: validate agrees)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import posttrain_cmd, read_metrics, run_env

BESIDE = Path(__file__).resolve().parents[1] / "fixtures" / "beside_workflow"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_imports_modules_beside_the_workflow(tmp_path, e2e_cache):
    workflow_dir = tmp_path / "workflow"
    shutil.copytree(BESIDE, workflow_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(
        posttrain_cmd(
            "run", str(workflow_dir / "workflow.yaml"), "--set", "reward.function=beside_exact"
        ),
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(workflow_dir / "runs" / "beside")
    assert [m["step"] for m in metrics] == [1, 2]
    # The environment's answers were scored by the reward function, in a worker process.
    assert all(m["reward/errors"] == 0 and m["env/errors"] == 0 for m in metrics)
