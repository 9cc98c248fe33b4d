"""The local launcher's ranks may start processes of their own, and never outlive the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from local_rank_helpers import hf_infer_spec

from posttrain.launch.local import LocalLauncher

HELPERS = Path(__file__).with_name("local_rank_helpers.py")


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for its (dead) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.timeout(180)
def test_a_rank_can_start_a_process(tiny_model_path, tmp_path):
    launcher = LocalLauncher(start_timeout_s=120)
    try:
        group = launcher.start_group(hf_infer_spec(tiny_model_path, str(tmp_path)))
        assert group.call("run_function", "local_rank_helpers:child_exit_code", 7) == [7]
        pids = [p.pid for p in group.procs]
    finally:
        launcher.shutdown()
    assert wait_gone(pids, 5) == []


@pytest.mark.timeout(180)
def test_two_driver_threads_calling_one_rank_each_get_their_own_answers(tiny_model_path, tmp_path):
    """The asynchronous rollout's producer and the loop may call the same processes at once:
    large answers read by two threads at a time must not tear."""
    launcher = LocalLauncher(start_timeout_s=120)
    answers: dict[str, list[bool]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def caller(name: str, index: int) -> None:
        try:
            for _ in range(20):
                got = group.call("run_function", "local_rank_helpers:payload", index, 1 << 20)
                answers[name].append(got == [bytes([index]) * (1 << 20)])
        except BaseException as exc:
            errors.append(exc)

    try:
        group = launcher.start_group(hf_infer_spec(tiny_model_path, str(tmp_path)))
        threads = [threading.Thread(target=caller, args=(n, i)) for i, n in enumerate("ab")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        launcher.shutdown()
    assert errors == []
    assert answers == {"a": [True] * 20, "b": [True] * 20}


def start_driver(model_path: str, run_dir: Path, mode: str):
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS), model_path, str(run_dir), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, f"driver printed no rank pids (exit code {proc.poll()})"
    return proc, pids


@pytest.mark.timeout(180)
def test_ranks_exit_when_the_driver_is_killed(tiny_model_path, tmp_path):
    proc, pids = start_driver(tiny_model_path, tmp_path, "kill")
    assert all(alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert wait_gone(pids, 20) == []


@pytest.mark.timeout(180)
def test_a_driver_that_returns_without_shutdown_stops_its_ranks(tiny_model_path, tmp_path):
    proc, pids = start_driver(tiny_model_path, tmp_path, "exit")
    assert proc.wait(timeout=30) == 0
    assert wait_gone(pids, 5) == []


def _raised_in(filename: str, error: BaseException) -> tuple:
    """``sys.exc_info()`` of ``error`` raised by code whose file is ``filename``."""
    code = compile("raise error", filename, "exec")
    try:
        exec(code, {"error": error})
    except BaseException:
        return sys.exc_info()
    raise AssertionError("not raised")


def test_a_rank_dying_in_a_tensor_handover_prints_no_traceback(monkeypatch, capsys):
    """multiprocessing's resource sharer reports a rank that went away mid-fetch through
    sys.excepthook, from the driver's thread: that one is kept off the console, nothing else."""
    from posttrain.launch import local

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: printed.append(info[1]))
    monkeypatch.setattr(local, "_quieted", [])
    local._quiet_handover_errors()
    local._quiet_handover_errors()  # (once a process: the second call changes nothing)
    sharer = os.path.join(os.path.dirname(os.__file__), "multiprocessing", "resource_sharer.py")
    reset = ConnectionResetError(104, "Connection reset by peer")
    sys.excepthook(*_raised_in(sharer, reset))
    assert printed == []
    other = ConnectionResetError(104, "elsewhere")
    sys.excepthook(*_raised_in(__file__, other))
    wrong_kind = ValueError("a real bug in the sharer")
    sys.excepthook(*_raised_in(sharer, wrong_kind))
    assert printed == [other, wrong_kind]
