"""Rank-side halves of the transports (called through ``run_function`` on worker ranks).

The broadcast transport's wire format, which an engine that receives the broadcasts itself
(``posttrain_weight_receiver``) must follow: the sync group is a ``torch.distributed`` group named
``group_name`` over a TCPStore that group rank 0 (trainer rank 0) hosts at ``addr:port``; rollout
rank ``r`` is group rank ``1 + r``. Each bucket is one broadcast from group rank 0 of a uint8
tensor: the bytes of the bucket's tensors, concatenated in the order of its metadata
``(name, shape, dtype, nbytes)`` (SGLang's ``flattened_bucket`` layout).

Streaming (:func:`stream_send` / :func:`stream_receive`): both loops run on the ranks, with no
driver call per bucket. The sending rank publishes bucket ``k``'s metadata of sync round ``n``
in the group's store under ``posttrain_meta/{n}/{k}`` (a pickled list; ``None`` ends the round)
and broadcasts its bytes; rollout ranks read the metadata from the store, then take part in the
broadcast (or hand it to their receiver).

In-process (:func:`hand_over`): trainer and rollout roles live in the same process (hybrid
engine); every trainer rank exports the full tensors on its device and its rollout peer loads
them as they come, with no copy through host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from posttrain.backends.distributed import collective_timeout_s
from posttrain.protocol import WeightBucket
from posttrain.weight_sync.verify import SyncLink, begin_sync

if TYPE_CHECKING:
    import torch.distributed as dist

    from posttrain.launch.worker import WorkerRuntime

META_PREFIX = "posttrain_meta/"
# A bucket's metadata: (name, shape, dtype without "torch.", nbytes) of each of its tensors.
BucketMeta = list[tuple[str, tuple[int, ...], str, int]]


def free_port(runtime: WorkerRuntime) -> int:
    """A TCP port free on this rank's host (the sync group's store listens there)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _named_group_store(store: dist.Store, group_name: str, device: str) -> dist.PrefixStore:
    """The keys of a process group named ``group_name`` in ``store``, laid out as torch's own
    named groups lay them out when made over a ``tcp://`` rendezvous (``PrefixStore(name)``, then
    ``"name/"``, then the device type): the layout of SGLang's ``init_weights_update_group``
    (OpenRLHF's and verl's ``init_custom_process_group``), so an engine that joins the group
    itself meets the core's ranks there."""
    import torch.distributed as dist

    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore("cuda/" if device.startswith("cuda") else "cpu/", named)


def join_sync_group(
    runtime: WorkerRuntime,
    addr: str,
    port: int,
    group_rank: int,
    size: int,
    timeout_s: float | None = None,
    group_name: str = "posttrain_weight_sync",
) -> bool:
    """Join a process group of trainer rank 0 (group rank 0) and every rollout rank.

    Made apart from each role's own default group, as SGLang's ``init_weights_update_group``.
    A rollout rank whose strategy answers ``posttrain_weight_receiver`` hands its place to that
    receiver (an engine whose own processes join the group and receive the broadcasts)."""
    ctx = runtime.ctx
    link = ctx.sync.link = SyncLink()  # a rank outside the group (-1) counts rounds only
    if group_rank < 0:
        return True
    timeout_s = timeout_s or collective_timeout_s()
    import torch.distributed as dist

    if group_rank > 0:
        receiver = ctx.hook.posttrain_weight_receiver(worker=ctx)
        if receiver is not None:
            receiver.join(addr, port, group_rank, size, group_name, timeout_s)
            link.receiver = (receiver, group_name)
            # The rank itself only reads the buckets' metadata from the group's store.
            store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            link.store = dist.PrefixStore(META_PREFIX, store)
            return True
    store = dist.TCPStore(
        addr, port, size, is_master=group_rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    link.store = dist.PrefixStore(META_PREFIX, store)
    prefixed = _named_group_store(store, group_name, ctx.device)
    if ctx.device.startswith("cuda"):
        group = dist.ProcessGroupNCCL(prefixed, group_rank, size)
    else:
        group = dist.ProcessGroupGloo(prefixed, group_rank, size, timedelta(seconds=timeout_s))
    link.group = (group, store)  # the TCP store lives as long as its group
    return True


def leave_sync_group(runtime: WorkerRuntime) -> bool:
    link, runtime.ctx.sync.link = runtime.ctx.sync.link, None
    if link is not None and link.receiver is not None:
        link.receiver[0].leave(link.receiver[1])
    return True


def _link(runtime: WorkerRuntime) -> SyncLink:
    link = runtime.ctx.sync.link
    if link is None:
        raise RuntimeError(f"{runtime.ctx.role} rank {runtime.ctx.rank} is in no sync group")
    return link


def bucket_meta(bucket: WeightBucket) -> BucketMeta:
    return [
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for name, t in bucket.tensors
    ]


def export_next_meta(runtime: WorkerRuntime) -> BucketMeta | None:
    """Advance the export; keep the bucket here and return its (name, shape, dtype, nbytes)."""
    bucket = runtime.export_next()
    if bucket is None:
        return None
    _link(runtime).pending = bucket
    return bucket_meta(bucket)


def _broadcast(runtime: WorkerRuntime, flat: torch.Tensor) -> dist.Work:
    """Start broadcasting ``flat`` from group rank 0; return the work to wait on."""
    import torch.distributed as dist

    group, _ = _link(runtime).group
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([flat], opts)


def _flatten(bucket: WeightBucket, device: str) -> torch.Tensor:
    return torch.cat(
        [
            t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
            for _, t in bucket.tensors
        ]
    )


def broadcast_pending(runtime: WorkerRuntime) -> bool:
    link = _link(runtime)
    bucket, link.pending = link.pending, None
    if link.group is None or bucket is None:
        return True  # not the sending rank
    _broadcast(runtime, _flatten(bucket, runtime.ctx.device)).wait()
    return True


def _receive_bucket(
    runtime: WorkerRuntime, meta: BucketMeta, digests: list[int] | None = None
) -> WeightBucket:
    total = sum(n for *_, n in meta)
    flat = torch.empty(total, dtype=torch.uint8, device=runtime.ctx.device)
    _broadcast(runtime, flat).wait()
    tensors, offset = [], 0
    for name, shape, dtype, nbytes in meta:
        piece = flat[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        tensors.append((name, piece))
        offset += nbytes
    return WeightBucket(tensors, digests)


def receive_and_import(runtime: WorkerRuntime, meta: BucketMeta) -> bool:
    receiver = _link(runtime).receiver
    if receiver is not None:
        return receiver[0].receive(meta, receiver[1])
    return runtime.import_weights([_receive_bucket(runtime, meta)])


def _next_round(runtime: WorkerRuntime) -> int:
    link = _link(runtime)
    link.rounds += 1
    return link.rounds


def stream_send(runtime: WorkerRuntime, bucket_bytes: int, verify: str = "first") -> dict[str, int]:
    """Trainer ranks: run the export (collective); the sending rank publishes each bucket's
    metadata and broadcasts its bytes, exporting bucket k+1 while bucket k is on the wire.

    The export stays on the device: on GPUs NCCL sends each bucket from the trainer's memory
    (a host copy and back cost 1.6 GB/s where NVLink gives over 50)."""
    import pickle

    sync_round = _next_round(runtime)
    begin_sync(runtime.ctx.sync, verify)
    link = _link(runtime)
    sending = link.group is not None
    store = link.store
    total, count = 0, 0
    in_flight = None  # (work, tensor): the tensor must outlive its broadcast
    for bucket in runtime.export_weights(bucket_bytes, on_device=True):
        if not sending or not bucket:
            continue
        # The sums first: a reader that sees the metadata finds them (posttrain.weight_sync.verify)
        store.set(f"{sync_round}/{count}/sums", pickle.dumps(bucket.digests))
        store.set(f"{sync_round}/{count}", pickle.dumps(bucket_meta(bucket)))
        flat = _flatten(bucket, runtime.ctx.device)
        work = _broadcast(runtime, flat)
        if in_flight is not None:
            in_flight[0].wait()
        in_flight = (work, flat)
        total += flat.numel()
        count += 1
    if in_flight is not None:
        in_flight[0].wait()
    if sending:
        store.set(f"{sync_round}/{count}", pickle.dumps(None))
        if sync_round > 1:  # every reader of the previous round is done with it by now
            for key in range(link.last_count + 1):
                store.delete_key(f"{sync_round - 1}/{key}")
                store.delete_key(f"{sync_round - 1}/{key}/sums")
        link.last_count = count
    return {"bytes": total, "buckets": count}


def stream_receive(runtime: WorkerRuntime) -> dict[str, int]:
    """Rollout ranks: read each bucket's metadata from the store and receive it (or let the
    engine's receiver take part in the broadcast), until the round's end marker."""
    import pickle

    sync_round = _next_round(runtime)
    store = _link(runtime).store
    receiver = _link(runtime).receiver
    counts = {"bytes": 0, "buckets": 0}

    def metas() -> Iterator[BucketMeta]:
        while True:
            meta = pickle.loads(store.get(f"{sync_round}/{counts['buckets']}"))
            if meta is None:
                return
            counts["buckets"] += 1
            counts["bytes"] += sum(n for *_, n in meta)
            yield meta

    if receiver is not None:
        for meta in metas():
            receiver[0].receive(meta, receiver[1])
    else:
        runtime.import_weights(
            _receive_bucket(runtime, meta, pickle.loads(store.get(f"{sync_round}/{n}/sums")))
            for n, meta in enumerate(metas())
        )
        counts["verified"] = runtime.ctx.sync.verified
    return counts


def hand_over(
    runtime: WorkerRuntime, target_role: str, bucket_bytes: int, verify: str = "first"
) -> dict[str, int]:
    """Hybrid engine: export on this rank's trainer role (every rank gathers the full tensors
    on its device) and load each bucket into ``target_role`` of the same process as it comes."""
    target = runtime.peers[target_role]
    begin_sync(runtime.ctx.sync, verify)
    counts = {"bytes": 0, "buckets": 0}
    buckets = runtime.export_weights(bucket_bytes, on_device=True)

    def counted() -> Iterator[WeightBucket]:
        for bucket in buckets:
            counts["bytes"] += bucket.nbytes
            counts["buckets"] += 1
            yield bucket

    target.import_weights(counted())
    for _ in buckets:  # the export is collective: finish it even if the import stopped early
        continue
    counts["verified"] = target.ctx.sync.verified
    return counts
