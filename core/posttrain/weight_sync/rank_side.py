"""Rank-side halves of the transports (called through ``run_function`` on worker ranks)."""

from __future__ import annotations

from datetime import timedelta

import torch

from posttrain.protocol import WeightBucket

_GROUP = "_sync_group"
_PENDING = "_sync_pending_bucket"


def free_port(runtime) -> int:
    """A TCP port free on this rank's host (the sync group's store listens there)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join_sync_group(
    runtime, addr: str, port: int, group_rank: int, size: int, timeout_s: float = 300.0
) -> bool:
    """Join a process group of trainer rank 0 (group rank 0) and every rollout rank.

    Made apart from each role's own default group, as SGLang's ``init_weights_update_group``."""
    if group_rank < 0:
        return True
    import torch.distributed as dist

    store = dist.TCPStore(
        addr, port, size, is_master=group_rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    if runtime.ctx.device.startswith("cuda"):
        group = dist.ProcessGroupNCCL(store, group_rank, size)
    else:
        group = dist.ProcessGroupGloo(store, group_rank, size, timedelta(seconds=timeout_s))
    runtime.ctx.state[_GROUP] = (group, store)
    return True


def leave_sync_group(runtime) -> bool:
    runtime.ctx.state.pop(_GROUP, None)
    return True


def export_next_meta(runtime):
    """Advance the export; keep the bucket here and return its (name, shape, dtype, nbytes)."""
    bucket = runtime.export_next()
    if bucket is None:
        return None
    runtime.ctx.state[_PENDING] = bucket
    return [
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for name, t in bucket.tensors
    ]


def _broadcast(runtime, flat: torch.Tensor) -> None:
    import torch.distributed as dist

    group, _ = runtime.ctx.state[_GROUP]
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([flat], opts).wait()


def broadcast_pending(runtime) -> bool:
    bucket = runtime.ctx.state.pop(_PENDING, None)
    if _GROUP not in runtime.ctx.state:
        return True  # not the sending rank
    device = runtime.ctx.device
    flat = torch.cat(
        [
            t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
            for _, t in bucket.tensors
        ]
    )
    _broadcast(runtime, flat)
    return True


def receive_and_import(runtime, meta) -> bool:
    total = sum(n for *_, n in meta)
    flat = torch.empty(total, dtype=torch.uint8, device=runtime.ctx.device)
    _broadcast(runtime, flat)
    tensors, offset = [], 0
    for name, shape, dtype, nbytes in meta:
        piece = flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        tensors.append((name, piece))
        offset += nbytes
    return runtime.import_weights([WeightBucket(tensors)])
