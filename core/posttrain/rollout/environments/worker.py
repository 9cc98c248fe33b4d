"""One worker process of ``environment.isolation: process`` (the child side of
:mod:`.process_pool`): it builds environments and answers their calls, one message at a time.

The worker leads a process session of its own, so the driver can kill it together with every
process its environments started (``killpg``), and a Ctrl-C in the terminal reaches only the
driver. A worker whose driver is gone (killed with SIGKILL, say) kills its session and exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from posttrain.rollout.environments.calls import Outcome, raised

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

# Messages from the driver besides calls (index, episode id, method, argument).
FORGET = "forget"  # drop every environment: the step's episodes are over
STOP = None
# How often a worker checks that its driver is still there.
PARENT_POLL_S = 0.5


def serve(conn: Connection, factory: Any, config: Any, parent_pid: int) -> None:
    """The worker's life: ``factory`` (a callable, or ``"module:attr"``) builds one environment
    from ``config`` for each ``create`` call; other calls go to the episode's environment."""
    os.setsid()
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if isinstance(factory, str):
        try:
            from posttrain.host.references import load_reference

            factory = load_reference(factory, "environment factory")
        except Exception as exc:  # reported by the driver as the pool's failure to start
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
    conn.send(("ready", os.getpid()))
    environments: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver closed its end
            return
        if message is STOP:
            return
        if message == FORGET:
            environments.clear()
            continue
        index, episode_id, method, argument = message
        outcome = _answer(environments, factory, config, episode_id, method, argument)
        try:
            conn.send((index, outcome))
        except Exception as exc:  # pickling failed before anything was written
            reason = f"answered something that cannot be sent back ({type(exc).__name__}: {exc})"
            conn.send((index, Outcome(error=reason)))


def _answer(
    environments: dict[str, Any],
    factory: Callable[[Any], Any],
    config: Any,
    episode_id: str,
    method: str,
    argument: Any,
) -> Outcome:
    try:
        if method == "create":
            environments[episode_id] = factory(config)
            return Outcome()
        return Outcome(value=getattr(environments[episode_id], method)(argument))
    # SystemExit and the like from environment code end the call, not the worker.
    except BaseException as exc:
        return raised(exc)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os.killpg(os.getpgrp(), signal.SIGKILL)  # this worker and what its environments started
