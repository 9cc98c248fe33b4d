"""The processes a rank started through multiprocessing, ended before the rank leaves.

A rank that leaves through ``os._exit`` (a test rank that is done, a rank whose driver is gone)
skips the interpreter's shutdown, which is what ends multiprocessing's children: a library's
``Manager`` server (megatron-core's asynchronous checkpoint writer starts one) or an engine's
own process would be left running, orphaned, with nothing to end it.
"""

from __future__ import annotations

import time

GRACE_S = 2.0


def end_children(grace_s: float = GRACE_S) -> None:
    """Terminate this process's multiprocessing children, wait up to ``grace_s`` for them and
    kill those still alive."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)
