"""Environment calls side by side, each in a daemon thread, none waited for past a timeout.

Python cannot stop a thread: a call that overruns is abandoned, and its daemon thread may end
later or never without holding up the run or the interpreter's exit. Calls run in threads, not
processes, because environments hold per-episode state the driver keeps between turns; a
CPU-bound environment shares one interpreter with the others, so its calls of one round add up
against ``environment.step_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class Outcome:
    value: Any = None
    # "TypeError: ..." when the call raised.
    error: str | None = None
    timed_out: bool = False


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[Outcome]:
    """Start every call at once; each one's outcome, in order, after at most ``timeout_s``."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    finished = [threading.Event() for _ in calls]

    def run(index: int) -> None:
        try:
            outcomes[index] = Outcome(value=calls[index]())
        except Exception as exc:  # environment code: a failure ends only its own episode
            outcomes[index] = Outcome(error=f"{type(exc).__name__}: {exc}")
        finally:
            finished[index].set()

    for index in range(len(calls)):
        threading.Thread(target=run, args=(index,), daemon=True, name="posttrain-env").start()
    deadline = time.monotonic() + timeout_s
    results = []
    for index, event in enumerate(finished):
        if not event.wait(max(0.0, deadline - time.monotonic())):
            results.append(Outcome(timed_out=True))
        else:
            # None: the call ended with a BaseException (SystemExit in user code).
            results.append(outcomes[index] or Outcome(error="the call did not return"))
    return results
