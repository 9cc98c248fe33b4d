"""A fatal signal in a run's process is reported with its stack: the fatal error read from a log
faulthandler wrote, and the driver's own death reported by its watcher with the rerun line
(tests/e2e/test_resume.py kills a rank of a real run with SIGSEGV)."""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys
import textwrap

import pytest

from posttrain.launch.fatal import driver_fatal_report, fatal_error, last_words, signal_name

# A process that dies of SIGSEGV in crash_here(), faulthandler writing into argv[1], while a
# second thread sleeps.
CRASH = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from posttrain.launch.fatal import report_fatal_signals
    log = open(sys.argv[1], "a", buffering=1)
    print("rank starting", file=log)
    report_fatal_signals(log)
    threading.Thread(target=lambda: time.sleep(600), daemon=True).start()
    def crash_here():
        os.kill(os.getpid(), signal.SIGSEGV)
    crash_here()
    """
)

# A driver: its run's steps in the history, then it dies in die_here() (of the signal named by
# argv[2]), or ends its run ("none").
DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys
    from posttrain.launch.fatal import driver_fatal_report
    from posttrain.launch.stacks import write_processes
    run_dir, how = sys.argv[1], sys.argv[2]
    history = os.path.join(run_dir, "history.jsonl")
    os.makedirs(run_dir, exist_ok=True)
    def die_here():
        os.kill(os.getpid(), getattr(signal, how))
    with driver_fatal_report(run_dir, history, "auto"):
        write_processes(run_dir, [])  # for posttrain stacks, while the run lives
        with open(history, "w") as f:
            f.writelines(json.dumps({"step": s, "reward/mean": 0.5}) + "\\n" for s in (1, 2))
        if how != "none":
            die_here()
    """
)


@pytest.mark.timeout(60)
def test_a_crashed_process_log_gives_its_fatal_error_and_stack(tmp_path):
    log = tmp_path / "rank1.log"
    proc = subprocess.run([sys.executable, "-c", CRASH, str(log)], timeout=30)
    assert proc.returncode == -signal.SIGSEGV
    assert signal_name(proc.returncode) == "SIGSEGV" and signal_name(1) is None
    words = last_words(str(log))
    printed, first, *stack = words.splitlines()
    assert printed == "rank starting"  # what it wrote before (a library's message)
    assert first == "Fatal Python error: Segmentation fault"
    assert stack[0].startswith("Current thread 0x"), words
    assert stack[1].endswith("in crash_here"), words  # the crashed thread, innermost first
    assert stack[-1].startswith("(every thread's stack is in "), words
    assert "Extension modules" not in words and "in <lambda>" not in words  # left in the log
    # A log that goes on after the fatal error (a later run appended to it) is read as before.
    with open(log, "a") as f:
        f.write("rank starting again\nValueError: later\n")
    assert fatal_error(log.read_text()) is None
    assert last_words(str(log), lines=2) == "rank starting again\nValueError: later\n"


def _driver(tmp_path, how: str) -> tuple[int, int, str]:
    """The fake driver's pid, exit code and stderr (its watcher's report)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "run"), how],
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = proc.communicate(timeout=60)  # till the watcher, which shares stderr, is done too
    return proc.pid, proc.returncode, err


@pytest.mark.timeout(60)
def test_a_driver_dead_of_sigsegv_is_reported_with_its_stack_and_the_rerun_line(tmp_path):
    pid, code, err = _driver(tmp_path, "SIGSEGV")
    assert code == -signal.SIGSEGV
    lines = err.splitlines()
    assert lines[0] == f"error: the driver (pid {pid}) died of a fatal signal:", err
    assert lines[1] == "Fatal Python error: Segmentation fault"
    assert lines[2].startswith("Current thread 0x") and lines[3].endswith("in die_here")
    assert lines[-2].startswith("(every thread's stack is in ")
    assert lines[-1] == (
        "the run stopped after step 2, with no checkpoint yet: a rerun starts over at step 1"
    )
    assert "die_here" in (tmp_path / "run" / "logs" / "driver.fatal.log").read_text()
    assert not (tmp_path / "run" / "logs" / "processes.json").exists()  # no live run left


@pytest.mark.timeout(60)
def test_a_driver_killed_without_a_word_is_reported_too_and_a_finished_one_is_not(tmp_path):
    pid, code, err = _driver(tmp_path, "SIGKILL")
    assert code == -signal.SIGKILL
    assert err.startswith(f"error: the driver (pid {pid}) ended before the run"), err
    assert err.endswith("a rerun starts over at step 1\n"), err
    assert _driver(tmp_path, "none")[1:] == (0, "")


def test_the_report_gives_faulthandler_back_as_it_was(tmp_path):
    history = str(tmp_path / "history.jsonl")
    before = faulthandler.is_enabled()
    with driver_fatal_report(str(tmp_path), history, "auto"):
        assert faulthandler.is_enabled()
    assert faulthandler.is_enabled() == before
