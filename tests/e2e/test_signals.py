"""Signals and a dead driver: a run started in the background from a script stops cleanly on
``kill -INT`` (its SIGINT inherited ignored), with the rerun line;
a driver killed while a rank waits in a collective leaves no rank behind."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import HANG_AT_STEP_5, QUICKSTART, posttrain_cmd, read_metrics, run_env, small_run


def start_run(run_dir: Path, *overrides: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        posttrain_cmd(
            "run",
            str(QUICKSTART),
            *small_run(max_steps=400, save_steps=2),
            *overrides,
            "--set",
            f"trainer.output_dir={run_dir}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env(),
        **popen,
    )


def wait_for(condition, proc: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def ignore_sigint() -> None:
    """What ``cmd &`` in a non-interactive shell does to the process it starts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_background_run_stops_cleanly_on_sigint(tmp_path, e2e_cache):
    """SIGTERM takes the same path (tests/core/test_cli.py)."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, preexec_fn=ignore_sigint)
    wait_for(lambda: (run_dir / "checkpoint-2").exists(), proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # The rerun line, from the checkpoint the run reached.
    said = " ".join(err.split())
    assert "interrupted" in said and "rerun the same command" in said, said[-2000:]
    assert "checkpoint-2" in said or "checkpoint-4" in said, said[-2000:]
    assert len(read_metrics(run_dir)) < 400
    assert not (run_dir / "logs" / "processes.json").exists()  # every rank stopped


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_driver_killed_during_a_collective_leaves_no_rank(tmp_path, e2e_cache):
    """Rank 0 blocks at step 5's update, rank 1 waits in its collective (for minutes: the
    timeouts are raised), then the driver is SIGKILLed: both ranks exit within seconds."""
    run_dir = tmp_path / "run"
    late = ("--set", "cluster.collective_timeout_s=600", "--set", "cluster.call_timeout_s=900")
    proc = start_run(run_dir, *HANG_AT_STEP_5, *late)
    wait_for(lambda: (run_dir / "hangs" / "step-5" / "summary.txt").exists(), proc)
    listed = json.loads((run_dir / "logs" / "processes.json").read_text())
    ranks = [p["pid"] for p in listed if p["label"] != "driver"]
    assert len(ranks) == 2, listed
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), [p for p in listed if alive(p["pid"])]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*rank*.log"))
    assert "the run's driver is gone" in logs and "this rank exits" in logs
