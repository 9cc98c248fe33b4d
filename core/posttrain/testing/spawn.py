"""Run a function on N new ranks with torch.distributed's environment set (for tests).

Backend tests drive engines by hand on 1-2 ranks: ``run_ranks("my_workers:scenario", 2, ...)``
imports ``my_workers`` in each child (children get the parent's ``sys.path`` and environment)
and calls
``scenario(rank, world_size, *args, **kwargs)`` after setting MASTER_ADDR/PORT, RANK, WORLD_SIZE
and LOCAL_RANK. A rank that raises prints its traceback and fails the run; a run that outlives
``timeout`` is terminated and raises :class:`TimeoutError`.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from typing import Any

from posttrain.launch.children import end_children
from posttrain.launch.local import free_port, rank_context


def run_ranks(
    target: str, world_size: int, *args: Any, timeout: float = 240.0, **kwargs: Any
) -> None:
    import torch
    import torch.multiprocessing as mp

    port = free_port()
    # Without a GPU, forks of the launcher's fork server (torch, transformers and the installed
    # engines' libraries imported once, posttrain.launch.local.rank_context), else spawned.
    method = "spawn" if torch.cuda.is_available() else rank_context("cpu").get_start_method()
    ctx = mp.start_processes(
        _entry,
        args=(world_size, port, target, args, kwargs, dict(os.environ), list(sys.path)),
        nprocs=world_size,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{target} on {world_size} ranks timed out after {timeout:.0f}s")


def _entry(
    rank: int,
    world_size: int,
    port: int,
    target: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: dict[str, str],
    path: list[str],
) -> None:
    import torch
    import torch.distributed as dist

    # A fork server's child has the server's environment and path, from when it started.
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    module, _, name = target.partition(":")
    try:
        getattr(importlib.import_module(module), name)(rank, world_size, *args, **kwargs)
    except Exception:
        traceback.print_exc()
        raise
    if dist.is_initialized():
        # Leave together: a rank tearing gloo down while a peer still finishes a collective
        # aborts the peer.
        dist.barrier()
        dist.destroy_process_group()
    # Done, and its results written: leave without the interpreter's shutdown. A 2-rank ZeRO-3
    # run on the CPU died in it now and then with "terminate called without an active
    # exception" (a native thread still running as the process unwinds), failing a run that
    # had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    end_children()  # os._exit skips what would end them
    os._exit(0)
