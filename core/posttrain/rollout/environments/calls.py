"""Environment calls side by side, each in a daemon thread, none waited for past a timeout
(``environment.isolation: thread``).

Python cannot stop a thread: a call that overruns is abandoned, and its daemon thread may end
later or never without holding up the run or the interpreter's exit. A CPU-bound environment
shares one interpreter with the others, so its calls of one round add up against
``environment.step_timeout_s``. ``isolation: process`` (:mod:`.process_pool`) kills what
overruns instead.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class Outcome:
    value: Any = None
    # "TypeError: ..." when the call raised (or why it could not be made).
    error: str | None = None
    timed_out: bool = False
    # The call could not answer (its worker process died, or its environment was lost with
    # another's): ``error`` says why.
    died: bool = False
    # The raised exception's formatted traceback, for RUN_DIR/logs/environments.log.
    traceback: str | None = None


def raised(exc: BaseException) -> Outcome:
    """The outcome of a call that raised ``exc`` (inside its ``except`` block)."""
    return Outcome(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[Outcome]:
    """Start every call at once; each one's outcome, in order, after at most ``timeout_s``."""
    outcomes: list[Outcome | None] = [None] * len(calls)
    finished = [threading.Event() for _ in calls]

    def run(index: int) -> None:
        try:
            outcomes[index] = Outcome(value=calls[index]())
        except Exception as exc:  # environment code: a failure ends only its own episode
            outcomes[index] = raised(exc)
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
