"""Helpers for end-to-end runs of ``posttrain run`` as a separate process."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

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


def kill_after_checkpoint(
    workflow: Path, run_dir: Path, *overrides: str, step: int = 3, last_step: int = 10
) -> None:
    """Start ``posttrain run workflow`` into ``run_dir`` and SIGKILL it once ``checkpoint-<step>``
    exists and a step after it has been logged (so the kill lands between checkpoints)."""
    proc = subprocess.Popen(
        posttrain_cmd("run", str(workflow), *overrides, "--set", f"trainer.output_dir={run_dir}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=run_env(),
    )
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if (
            (run_dir / f"checkpoint-{step}").exists()
            and metrics.exists()
            and len(metrics.read_text().splitlines()) > step
        ):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (run_dir / f"checkpoint-{last_step}").exists(), "killed too late to test anything"


# hang_plugin blocks rank 0 at step 5's train step; the watchdog reports at 2 s, rank 1's
# collective times out at 8 s, the driver would give up at 12 s.
HANG_AT_STEP_5 = (
    "--set",
    "plugins=[hang_plugin]",
    "--set",
    "cluster.runtime_env.env_vars.POSTTRAIN_TEST_HANG_AT_STEP=5",
    "--set",
    "cluster.hang_report_s=2",
    "--set",
    "cluster.collective_timeout_s=8",
    "--set",
    "cluster.call_timeout_s=12",
)


def assert_hang_reported(run_dir: Path, hung: subprocess.CompletedProcess) -> str:
    """The run of HANG_AT_STEP_5 reported the hang (the blocked rank in its frame, the other in
    the collective, a file per process) and stopped with the collective's error and no
    traceback. Returns its stderr, whitespace-joined."""
    out, err = " ".join(hung.stdout.split()), " ".join(hung.stderr.split())
    assert hung.returncode == 1, hung.stdout[-3000:] + hung.stderr[-3000:]
    assert "Traceback" not in hung.stderr
    assert "hang report (step 5): actor_train.train_step has run" in out, out[-3000:]
    report = (run_dir / "hangs" / "step-5" / "summary.txt").read_text()
    shared = "actor_train+actor_infer+reference"
    lines = {line.split(":")[0].strip(): line for line in report.splitlines()}
    assert "in block_here (hang_plugin.py:" in lines[f"{shared} rank 0"], report
    assert "waiting in torch.distributed" in lines[f"{shared} rank 1"], report
    assert "driver" in lines, report
    files = sorted(p.name for p in (run_dir / "hangs" / "step-5").iterdir())
    ranks = [f"{shared.replace('+', '_')}_rank_{r}.txt" for r in (0, 1)]
    assert files == sorted(["driver.txt", "summary.txt", *ranks])
    # Rank 1's collective timed out first (collective_timeout_s < call_timeout_s), named.
    assert "actor_train rank 1" in err and "(in torch.distributed" in err, err[-3000:]
    assert not (run_dir / "logs" / "processes.json").exists()
    return err


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The records of a step log of the run (``history.jsonl``: the run's own history)."""
    with open(run_dir / name) as f:
        return [json.loads(line) for line in f]


def run_example_steps(
    workflow: Path, run_dir: Path, steps: int, sets: dict | None = None
) -> list[dict]:
    """Run an example workflow into ``run_dir`` for ``steps`` steps (``sets``: more ``--set``
    overrides, as ``{"algorithm.rollout_batch_size": 8}``) and return its metrics.jsonl,
    checked: one record per step, no environment errors or timeouts, curves drawn."""
    sets = {"trainer.max_steps": steps, **(sets or {}), "trainer.logger": "[jsonl]"}
    overrides = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    run_quickstart(run_dir, *overrides, workflow=workflow, timeout=600)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in metrics)
    assert (run_dir / "curves.png").exists()
    return metrics


class EarlyLate(NamedTuple):
    """A metric's mean over a run's first 3 steps and over its last 5."""

    first: float
    last: float


def early_late(metrics: list[dict], key: str) -> EarlyLate:
    """``key``'s mean at the start of the run and at its end: what a learning test compares."""
    return EarlyLate(
        first=statistics.mean(m[key] for m in metrics[:3]),
        last=statistics.mean(m[key] for m in metrics[-5:]),
    )


@pytest.fixture(scope="session")
def e2e_cache(posttrain_cache):
    return posttrain_cache
