"""A run killed with SIGKILL (between checkpoints, and while writing one) resumes with
``resume: auto`` and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    QUICKSTART,
    kill_after_checkpoint,
    posttrain_cmd,
    read_metrics,
    run_env,
    run_quickstart,
    small_run,
)
from safetensors.torch import load_file

SMALL = small_run(max_steps=10, save_steps=3)


def run(run_dir: Path, *extra: str, env=None, check=True) -> subprocess.CompletedProcess:
    return run_quickstart(run_dir, *SMALL, *extra, env=env, check=check)


def final_weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        posttrain_cmd("export-hf", str(run_dir / "checkpoint-10"), str(out)),
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def rewards_by_step(run_dir: Path) -> dict[int, float]:
    # A resumed run appends: the later line of a step wins, as it does in the checkpoint.
    return {m["step"]: m["reward/mean"] for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, e2e_cache):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run(run_dir)
    return run_dir, final_weights(run_dir, run_dir / "hf")


def assert_same_run(resumed: Path, uninterrupted) -> None:
    reference_dir, reference_weights = uninterrupted
    assert rewards_by_step(resumed) == rewards_by_step(reference_dir)
    weights = final_weights(resumed, resumed / "hf")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_between_checkpoints_then_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(QUICKSTART, run_dir, *SMALL)
    run(run_dir)
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_while_writing_a_checkpoint_then_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed-in-save"
    crash = run(
        run_dir,
        "--set",
        "plugins=[crash_plugin]",
        check=False,
        env=run_env(POSTTRAIN_TEST_CRASH_AT_CHECKPOINT="6"),
    )
    assert crash.returncode == -signal.SIGKILL
    # The interrupted checkpoint was never renamed into place; the previous one is intact.
    assert (run_dir / ".checkpoint-6.tmp").exists()
    assert not (run_dir / "checkpoint-6").exists()
    assert (run_dir / "checkpoint-3" / "manifest.json").exists()
    run(run_dir)
    assert not (run_dir / ".checkpoint-6.tmp").exists()
    assert_same_run(run_dir, uninterrupted)
