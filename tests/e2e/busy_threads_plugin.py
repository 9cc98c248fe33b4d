"""Test-only plugin, loaded through a workflow's ``plugins:`` list: every process that loads it
(the driver and each rank) runs Python threads whose frames change all the time, as a live
run's threads do (loggers, savers, engines' helpers), only more often.

- one thread recurses deep enough to cross a chunk of the thread's frame stack: CPython 3.11+
  allocates a chunk on the way down and frees it on the way back;
- one thread starts short-lived threads and joins them: each ends freeing its thread state.

Reading those frames without the GIL (faulthandler's dump, from a signal handler) crashed the
process it was asked of (docs/hangs.md). The threads sleep most of the time, so that the run
keeps its pace on two cores; they touch no random state, so the run's results are unchanged.

Enabled by ``POSTTRAIN_TEST_BUSY_THREADS=1`` in the driver's environment (local ranks inherit
it). With ``POSTTRAIN_TEST_BUSY_HOLD_AT_STEP=N`` and ``POSTTRAIN_TEST_BUSY_RELEASE=PATH``, the
driver waits after step N until PATH exists (at most 120 s), so that a test asks a live run as
often as it means to, however fast the steps go; the run's results are the same.
"""

import os
import threading
import time

from posttrain import hookimpl

# Deeper than one 16 KiB chunk of frames holds (about 100 of these).
DEPTH = 300


def _deep(n: int) -> int:
    return 0 if n == 0 else _deep(n - 1) + 1


def _recurse_forever() -> None:
    while True:
        for _ in range(5):
            _deep(DEPTH)
        time.sleep(0.002)


def _start_and_end_threads() -> None:
    while True:
        thread = threading.Thread(target=_deep, args=(50,), name="busy-threads-short")
        thread.start()
        thread.join()
        time.sleep(0.002)


if os.environ.get("POSTTRAIN_TEST_BUSY_THREADS") == "1":
    for body in (_recurse_forever, _start_and_end_threads):
        threading.Thread(target=body, name=f"busy-threads{body.__name__}", daemon=True).start()


@hookimpl
def posttrain_step_metrics(step, metrics):
    hold_at = os.environ.get("POSTTRAIN_TEST_BUSY_HOLD_AT_STEP")
    release = os.environ.get("POSTTRAIN_TEST_BUSY_RELEASE", "")
    if hold_at and step == int(hold_at):
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    return None
