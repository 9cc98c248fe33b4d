"""The hang watchdog's parts: stacks taken from a live process blocked in C (answered by a thread
of its own; faulthandler on SIGUSR1 when its GIL is held), asked 200 times of a busy process,
the one-line description of where it is, the automatic threshold, the report's files, and the
workflow checks of the timeouts (tests/e2e/test_resume.py and test_ray.py block a rank of a real
run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posttrain.launch.hang_watch import AUTO_FIRST_S, AUTO_MIN_S, HangWatch
from posttrain.launch.stacks import (
    collect_stacks,
    describe,
    file_head,
    is_fallback,
    main_thread_frames,
    target,
    this_node,
    where,
)

# A process whose main thread blocks in C (a lock's acquire, as a rank blocks in a collective)
# inside wait_for_peer(); a second thread sleeps.
BLOCKED = textwrap.dedent(
    """
    import sys, threading, time
    from posttrain.launch.stacks import install_stack_dump
    install_stack_dump(sys.argv[1])
    threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
    def wait_for_peer():
        print("ready", flush=True)
        threading.Lock().acquire() or threading.Lock().acquire()
        lock = threading.Lock(); lock.acquire(); lock.acquire()
    wait_for_peer()
    """
)


# The same, but its main thread sleeps in C holding the GIL (a C function called through
# ctypes.PyDLL keeps it): no other thread of the process can run Python code.
GIL_HELD = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    from posttrain.launch.stacks import install_stack_dump
    install_stack_dump(sys.argv[1])
    threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
    def wait_for_peer():
        sleep = ctypes.PyDLL(None).sleep
        print("ready", flush=True)
        while True:  # a signal ends the C sleep early
            sleep(600)
    wait_for_peer()
    """
)
# Threads that push and pop frames across the frame stack's chunks and start and end threads
# (tests/e2e/busy_threads_plugin.py): faulthandler's dump, asked for from outside, crashed
# such a process within tens of calls.
BUSY = textwrap.dedent(
    """
    import sys, time
    from posttrain.launch.stacks import install_stack_dump
    install_stack_dump(sys.argv[1])
    import busy_threads_plugin
    print("ready", flush=True)
    while True:
        busy_threads_plugin._deep(200)
        time.sleep(0.001)
    """
)
E2E = Path(__file__).resolve().parents[1] / "e2e"


def _start(script: str, tmp_path, label: str, env=None):
    stacks = tmp_path / f"{label}.stacks"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(stacks)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc, target(label, proc.pid, this_node(), str(stacks))


@pytest.fixture
def blocked(tmp_path):
    proc, blocked = _start(BLOCKED, tmp_path, "blocked rank")
    yield blocked
    proc.kill()
    proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_stacks_of_a_process_blocked_in_c_name_its_function(blocked):
    dumps = collect_stacks([blocked])
    assert not is_fallback(dumps["blocked rank"])  # answered by the process's own thread
    frames = main_thread_frames(dumps["blocked rank"], file_head(blocked.stacks_path))
    assert frames[0].func == "wait_for_peer"  # the main thread, not the sleeping one
    assert describe(frames).startswith("in wait_for_peer (<string>:")
    # Asked again, the process answers again (the handler stays; the process lives on).
    again = collect_stacks([blocked])["blocked rank"]
    assert "wait_for_peer" in again


@pytest.mark.timeout(60)
def test_a_process_whose_gil_is_held_is_dumped_by_faulthandler_and_says_so(tmp_path):
    proc, held = _start(GIL_HELD, tmp_path, "held rank")
    try:
        time.sleep(0.2)  # from "ready" into the C call
        started = time.monotonic()
        dump = collect_stacks([held], answer_s=0.5)["held rank"]
        assert time.monotonic() - started < 5.0
        assert is_fallback(dump), dump
        frames, line = where(dump, file_head(held.stacks_path))
        assert frames[0].func == "wait_for_peer", dump
        assert line.endswith("(faulthandler's dump: no answer in time)"), line
        assert proc.poll() is None  # the process lives on
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_200_asks_of_a_process_with_busy_threads_leave_it_running(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(E2E), "POSTTRAIN_TEST_BUSY_THREADS": "1"}
    proc, busy = _start(BUSY, tmp_path, "busy rank", env=env)
    try:
        for _ in range(200):
            dump = collect_stacks([busy])["busy rank"]
            assert not is_fallback(dump), dump
            assert main_thread_frames(dump)[-1].func == "<module>", dump
        assert proc.poll() is None
        # Every thread of the process but the one that answers, by name.
        assert "[busy-threads_recurse_forever]" in dump and "[MainThread]" in dump
        assert "posttrain-stacks" not in dump
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_process_without_the_handler_is_never_signalled(tmp_path):
    # Listed, but it has not registered faulthandler (a rank still starting): SIGUSR1 would
    # kill it.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        starting = target("starting rank", proc.pid, this_node(), str(tmp_path / "none.stacks"))
        dump = collect_stacks([starting], answer_s=0.2)["starting rank"]
        assert dump == f"(no answer from process {proc.pid} in 0.2s)\n"
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_an_exited_or_recycled_pid_is_never_signalled(blocked, tmp_path):
    import attrs

    other = attrs.evolve(blocked, label="recycled", start_time="1")  # not the listed process
    dumps = collect_stacks([other])
    assert dumps["recycled"].startswith(f"(process {blocked.pid} has exited)")
    remote = attrs.evolve(blocked, label="remote", node="elsewhere")
    assert "on node elsewhere" in collect_stacks([remote])["remote"]


def test_a_collective_is_named_by_its_public_function():
    from posttrain.launch.stacks import Frame

    base = "/x/site-packages/torch/distributed/"
    frames = [
        Frame(base + "distributed_c10d.py", 3252, "all_reduce"),
        Frame(base + "c10d_logger.py", 83, "wrapper"),
        Frame("/repo/core/posttrain/backends/distributed.py", 54, "agree_max"),
    ]
    assert describe(frames) == (
        "waiting in torch.distributed all_reduce (torch/distributed/distributed_c10d.py), "
        "in agree_max (distributed.py:54)"
    )


def test_automatic_threshold_follows_the_calls_median(tmp_path):
    watch = HangWatch(str(tmp_path), None, call_timeout_s=1800, show=print)
    assert watch.threshold("actor_train", "train_step") == AUTO_FIRST_S
    for seconds in (500.0, 2.0, 3.0):  # the first is a warm-up (compilation, caches)
        watch.finished("actor_train", "train_step", seconds)
    assert watch.threshold("actor_train", "train_step") == AUTO_MIN_S
    for seconds in (40.0, 50.0):
        watch.finished("actor_train", "train_step", seconds)
    assert watch.threshold("actor_train", "train_step") == 10 * (3.0 + 40.0) / 2  # the median
    # Never later than half of call_timeout_s, so that the report comes before the run stops.
    short = HangWatch(str(tmp_path), None, call_timeout_s=100, show=print)
    assert short.threshold("actor_train", "train_step") == 50.0
    assert HangWatch(str(tmp_path), 5.0, 1800, print).threshold("x", "y") == 5.0


def test_a_report_writes_each_process_and_a_summary_once_per_call(blocked, tmp_path):
    shown = []
    watch = HangWatch(str(tmp_path), 1.0, 60, show=shown.append, own=(blocked,))
    watch.step = 7
    watch.check("call-1", "reference", "compute_logprobs", elapsed=0.5)
    assert not shown
    watch.check("call-1", "reference", "compute_logprobs", elapsed=1.5)
    watch.check("call-1", "reference", "compute_logprobs", elapsed=2.5)  # reported already
    assert len(shown) == 1
    assert shown[0].startswith("hang report (step 7): reference.compute_logprobs has run 2s")
    assert "  blocked rank: in wait_for_peer" in shown[0]
    out = tmp_path / "hangs" / "step-7"
    assert sorted(p.name for p in out.iterdir()) == ["blocked_rank.txt", "summary.txt"]
    assert "wait_for_peer" in (out / "blocked_rank.txt").read_text()
    time.sleep(0.01)
    watch.check("call-2", "reference", "compute_logprobs", elapsed=1.5)  # the same step again
    assert (tmp_path / "hangs" / "step-7-2" / "summary.txt").exists()


def test_timeouts_that_cannot_come_first_are_errors(fake_train_host, model_dir, tmp_path):
    from test_config_validation import _valid_raw

    from posttrain.config.report import ErrorReport
    from posttrain.loading.workflow import build_workflow

    raw = _valid_raw(str(model_dir))
    raw["cluster"] = {"call_timeout_s": 60, "hang_report_s": 60, "collective_timeout_s": 90}
    _, report = build_workflow(raw, fake_train_host, ErrorReport(), base_dir=str(tmp_path))
    errors = {issue.path: issue.render() for issue in report.errors}
    assert sorted(errors) == ["cluster.collective_timeout_s", "cluster.hang_report_s"]
    assert "90 is not below cluster.call_timeout_s (60)" in errors["cluster.collective_timeout_s"]
    raw["cluster"] = {"call_timeout_s": 60}
    workflow, report = build_workflow(raw, fake_train_host, ErrorReport(), base_dir=str(tmp_path))
    assert report.errors == [] and workflow.cluster.collective_timeout() == 30
