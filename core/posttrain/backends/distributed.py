"""torch.distributed set-up from the environment the launchers provide."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


# The launchers set it from cluster.collective_timeout_s (below cluster.call_timeout_s).
COLLECTIVE_TIMEOUT_ENV = "POSTTRAIN_COLLECTIVE_TIMEOUT_S"


def collective_timeout_s() -> float:
    """How long a collective of this rank's process groups may wait before it raises (the
    workflow's ``cluster.collective_timeout_s``; 600 s outside a run)."""
    return float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "600"))


def init_default_process_group(device: str, timeout_s: float | None = None) -> None:
    """Join this role's process group (MASTER_ADDR/PORT, RANK, WORLD_SIZE are set); its
    collectives time out after ``timeout_s`` (default: :func:`collective_timeout_s`)."""
    timeout_s = timeout_s or collective_timeout_s()
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=timeout_s))


def destroy_default_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the default group's ranks (in place; itself without a group)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def agree_max(value: int, device: torch.device | str) -> int:
    """The largest ``value`` over the default group's ranks (e.g. micro-batch counts, which
    every rank must run alike for collectives to line up)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
