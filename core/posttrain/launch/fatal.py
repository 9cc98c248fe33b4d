"""Fatal signals (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) in a run's processes, reported on
the console: which process, its stack, and what a rerun does.

No Python code runs in a process after a fatal signal, so :mod:`faulthandler` writes the stack
from its C handler into the process's log, and another process reports it:

- a rank's log is ``RUN_DIR/logs/<roles>.rank<r>.log``; the driver, finding the process gone,
  reports the fatal error from the log (:func:`last_words`) with the rerun line, as for any
  rank that fails;
- the driver's is ``RUN_DIR/logs/driver.fatal.log``; a small watcher process (this module, run
  with ``-m``), started with the run, waits for the driver to say the run ended; when the
  driver is gone without saying so, the watcher prints the stack and the rerun line.

Run as a module by the driver only: it imports nothing heavy while it waits.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import TextIO

from posttrain.launch.stacks import process_start_time, remove_processes
from posttrain.paths import display_path

DRIVER_FATAL_LOG = "driver.fatal.log"
_FATAL = "Fatal Python error: "
_FINISHED = b"finished\n"
# The lines faulthandler writes after its first: threads, their frames (indented), and the
# extension modules that were loaded.
_DUMP_LINES = (" ", "Current thread 0x", "Thread 0x", "Stack (most recent", "Extension modules:")


def report_fatal_signals(log: TextIO) -> None:
    """On a fatal signal, write every thread's stack into ``log`` (the process's own)."""
    faulthandler.enable(file=log, all_threads=True)


def fatal_error(text: str) -> str | None:
    """The fatal error faulthandler wrote at the end of ``text`` (a log): its first line and the
    crashed thread's stack (the other threads' stay in the log); None when the log ends
    otherwise (a log appended to by later runs may hold an earlier run's)."""
    start = text.rfind(_FATAL)
    if start < 0 or (start and text[start - 1] != "\n"):
        return None
    lines = text[start:].splitlines()
    if not all(not line.strip() or line.startswith(_DUMP_LINES) for line in lines[1:]):
        return None
    # faulthandler lists the threads in the interpreter's order, the crashed one marked
    # "Current thread" wherever it comes; a blank line ends each.
    crashed: list[str] = []
    for line in lines[1:]:
        if crashed and not line.strip():
            break
        if crashed or line.startswith("Current thread 0x"):
            crashed.append(line)
    return "\n".join([lines[0], *crashed])


def last_words(log_path: str, lines: int = 20, before_fatal: int = 8) -> str:
    """What a process that ended left at the end of its log: its fatal error with the stack,
    after the ``before_fatal`` lines it wrote before it (a native library's own message, such
    as NCCL's before an abort), where it has one; else the last ``lines`` lines."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    fatal = fatal_error(text)
    if fatal is None:
        return "".join(text.splitlines(keepends=True)[-lines:])
    before = text[: text.rfind(_FATAL)].splitlines(keepends=True)[-before_fatal:]
    where = f"(every thread's stack is in {display_path(log_path)})"
    return "".join(before) + f"{fatal}\n{where}\n"


def signal_name(exitcode: int | None) -> str | None:
    """``SIGSEGV`` for a process's exit code -11 (multiprocessing's way of saying that it died of
    a signal); None for an exit with a code."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


# -- the driver ------------------------------------------------------------------------------


@contextlib.contextmanager
def driver_fatal_report(run_dir: str, history: str, resume_setting: str) -> Iterator[None]:
    """While the driver runs the run in ``run_dir`` (its steps recorded in ``history``): its
    stack goes to ``driver.fatal.log`` on a fatal signal, and a watcher reports its death on the
    console (see the module docstring)."""
    path = os.path.join(run_dir, "logs", DRIVER_FATAL_LOG)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    was_enabled = faulthandler.is_enabled()
    log = open(path, "w", encoding="utf-8")  # noqa: SIM115 (faulthandler holds it until the end)
    faulthandler.enable(file=log, all_threads=True)
    # The watcher reads the pipe's end; the driver holds the other until it ends (not inherited
    # by the ranks: os.pipe's ends are not inheritable), so the watcher sees it end either way.
    watch_end, driver_end = os.pipe()
    try:
        watcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "posttrain.launch.fatal",
                f"--pid={os.getpid()}",
                f"--start-time={process_start_time(os.getpid())}",
                f"--log={path}",
                f"--run-dir={run_dir}",
                f"--history={history}",
                f"--resume={resume_setting}",
            ],
            stdin=watch_end,
            stdout=subprocess.DEVNULL,
        )
    finally:
        os.close(watch_end)
    try:
        yield
    finally:
        # A watcher killed with the process group (its SIGINT is ignored) has nothing to hear.
        with contextlib.suppress(BrokenPipeError):
            os.write(driver_end, _FINISHED)
        os.close(driver_end)
        watcher.wait(timeout=30)
        # Before the log closes: faulthandler writes to its file descriptor, whatever holds it.
        if was_enabled:  # as it was (pytest's own, when a test runs a run in its process)
            # (sys.__stderr__ is None only without a console; faulthandler then takes sys.stderr)
            faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
        else:
            faulthandler.disable()
        log.close()


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name (the state first), or [] when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _alive(pid: int, start_time: str) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` still runs (a zombie does
    not: it waits to be reaped, dead)."""
    stat = _stat(pid)
    return bool(stat) and stat[19] == start_time and stat[0] not in ("Z", "X")


def _wait_for_driver(pid: int, start_time: str) -> bool:
    """Wait until the driver says the run ended (True) or is gone without saying so (False).
    The pipe's end closes when the driver ends; its pid is watched too, in case a process it
    forked holds the pipe open."""
    said = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 1.0)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 64)
            said += chunk
            if said.endswith(_FINISHED):
                return True
            if not chunk:
                return False
        elif start_time and not _alive(pid, start_time):
            return False


def _last_step(history: str) -> int:
    """The last step in the run's history (the driver's record of each step it finished)."""
    last = 0
    try:
        with open(history, encoding="utf-8") as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line)["step"]))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    break  # a line cut short by the death: the steps before it stand
    except OSError:
        return 0
    return last


def driver_death(pid: int, log_path: str, run_dir: str, history: str, resume_setting: str) -> str:
    """What the console is told when the driver died: the fatal error and its stack when
    faulthandler wrote one, and what a rerun does."""
    from posttrain.checkpoint.resume import rerun_hint

    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            fatal = fatal_error(f.read())
    except OSError:
        fatal = None
    if fatal is not None:
        head = f"error: the driver (pid {pid}) died of a fatal signal:\n{fatal}\n"
        head += f"(every thread's stack is in {display_path(log_path)})\n"
    else:
        head = (
            f"error: the driver (pid {pid}) ended before the run did, with no fatal error in "
            f"{display_path(log_path)} (SIGKILL, SIGTERM or the out-of-memory killer)\n"
        )
    hint = rerun_hint(run_dir, _last_step(history), resume_setting)
    return f"{head}the run stopped {hint}\n"


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C reaches the whole foreground group: it is the driver's to handle and report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m posttrain.launch.fatal")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-time", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--resume", required=True)
    args = parser.parse_args(argv)
    if not _wait_for_driver(args.pid, args.start_time):
        remove_processes(args.run_dir)  # posttrain stacks: no live run here any more
        report = driver_death(args.pid, args.log, args.run_dir, args.history, args.resume)
        sys.stderr.write(report)
        sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
