"""Rank-side halves of the transports (called through ``run_function`` on worker ranks).

The broadcast transport's wire format, which an engine that receives the broadcasts itself
(``posttrain_weight_receiver``) must follow: the sync group is a ``torch.distributed`` group named
``group_name`` over a TCPStore that group rank 0 (trainer rank 0) hosts at ``addr:port``; rollout
rank ``r`` is group rank ``1 + r``. Each bucket is one broadcast from group rank 0 of a uint8
tensor: the bytes of the bucket's tensors, concatenated in the order of its metadata
``(name, shape, dtype, nbytes)`` (SGLang's ``flattened_bucket`` layout).
"""

from __future__ import annotations

from datetime import timedelta

import torch

from posttrain.protocol import WeightBucket

_GROUP = "_sync_group"
_PENDING = "_sync_pending_bucket"
_RECEIVER = "_sync_receiver"


def free_port(runtime) -> int:
    """A TCP port free on this rank's host (the sync group's store listens there)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _named_group_store(store, group_name: str, device: str):
    """The keys of a process group named ``group_name`` in ``store``, laid out as torch's own
    named groups lay them out when made over a ``tcp://`` rendezvous (``PrefixStore(name)``, then
    ``"name/"``, then the device type): the layout of SGLang's ``init_weights_update_group``
    (OpenRLHF's and verl's ``init_custom_process_group``), so an engine that joins the group
    itself meets the core's ranks there."""
    import torch.distributed as dist

    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore("cuda/" if device.startswith("cuda") else "cpu/", named)


def join_sync_group(
    runtime,
    addr: str,
    port: int,
    group_rank: int,
    size: int,
    timeout_s: float = 300.0,
    group_name: str = "posttrain_weight_sync",
) -> bool:
    """Join a process group of trainer rank 0 (group rank 0) and every rollout rank.

    Made apart from each role's own default group, as SGLang's ``init_weights_update_group``.
    A rollout rank whose strategy answers ``posttrain_weight_receiver`` hands its place to that
    receiver (an engine whose own processes join the group and receive the broadcasts)."""
    if group_rank < 0:
        return True
    ctx = runtime.ctx
    if group_rank > 0:
        receiver = ctx.hook.posttrain_weight_receiver(worker=ctx)
        if receiver is not None:
            receiver.join(addr, port, group_rank, size, group_name, timeout_s)
            ctx.state[_RECEIVER] = (receiver, group_name)
            return True
    import torch.distributed as dist

    store = dist.TCPStore(
        addr, port, size, is_master=group_rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    prefixed = _named_group_store(store, group_name, ctx.device)
    if ctx.device.startswith("cuda"):
        group = dist.ProcessGroupNCCL(prefixed, group_rank, size)
    else:
        group = dist.ProcessGroupGloo(prefixed, group_rank, size, timedelta(seconds=timeout_s))
    ctx.state[_GROUP] = (group, store)
    return True


def leave_sync_group(runtime) -> bool:
    runtime.ctx.state.pop(_GROUP, None)
    receiver = runtime.ctx.state.pop(_RECEIVER, None)
    if receiver is not None:
        receiver[0].leave(receiver[1])
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
    receiver = runtime.ctx.state.get(_RECEIVER)
    if receiver is not None:
        return receiver[0].receive(meta, receiver[1])
    total = sum(n for *_, n in meta)
    flat = torch.empty(total, dtype=torch.uint8, device=runtime.ctx.device)
    _broadcast(runtime, flat)
    tensors, offset = [], 0
    for name, shape, dtype, nbytes in meta:
        piece = flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        tensors.append((name, piece))
        offset += nbytes
    return runtime.import_weights([WeightBucket(tensors)])
