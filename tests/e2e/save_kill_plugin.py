"""Test-only plugin, loaded through a workflow's ``plugins:`` list: SIGKILLs the run at one
chosen moment of the checkpoint save of one step, as a crash would.

``POSTTRAIN_TEST_SAVE_KILL=<step>:<who>:<n>``: in process ``<who>`` (``driver``, or ``rank<r>``),
at the ``n``-th file-system event (a file opened for writing, a directory made, a rename, a
removal) on a checkpoint path, counted from the first event on ``.checkpoint-<step>.tmp``. A
rank kills the driver (its parent), then itself. Python's audit hooks see these events wherever
they happen (DCP's and megatron's writer threads, the driver's finaliser) with nothing patched.
With ``n`` = 0 nothing is killed. Every counted event is appended, numbered, to the file named
by ``POSTTRAIN_TEST_SAVE_KILL_LOG`` (when set), so a test can say where each kill landed.
"""

import os
import signal
import sys

_EVENTS = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree"}
_state = {"count": 0, "busy": False}


def _who() -> str:
    rank = os.environ.get("RANK")
    return "driver" if rank is None else f"rank{rank}"


def _writes(event: str, args: tuple) -> bool:
    if event != "open":
        return True
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _audit(event: str, args: tuple) -> None:
    if event not in _EVENTS or _state["busy"] or not _writes(event, args):
        return
    paths = [str(a) for a in args[:2] if isinstance(a, str | os.PathLike)]
    step, who, n = os.environ["POSTTRAIN_TEST_SAVE_KILL"].split(":")
    if not _state["count"] and not any(f".checkpoint-{step}.tmp" in p for p in paths):
        return
    if not any("checkpoint-" in p for p in paths) or _who() != who:
        return
    _state["count"] += 1
    _state["busy"] = True  # the log's own open is an event too
    log = os.environ.get("POSTTRAIN_TEST_SAVE_KILL_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{who} {_state['count']} {event} {' -> '.join(paths)}\n")
    _state["busy"] = False
    if _state["count"] == int(n):
        if who != "driver":
            os.kill(int(os.environ["POSTTRAIN_DRIVER_PID"]), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("POSTTRAIN_TEST_SAVE_KILL"):
    sys.addaudithook(_audit)
