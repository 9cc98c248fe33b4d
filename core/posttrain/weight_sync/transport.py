"""Transports move exported buckets from the trainer group to the rollout group.

A transport runs on the driver and drives both groups; the rank-side half of a transport lives
in :mod:`posttrain.weight_sync.rank_side` and is invoked through ``run_function``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.launch.base import WorkerGroup

RANK_SIDE = "posttrain.weight_sync.rank_side"


class WeightTransport(abc.ABC):
    name: str = ""
    # Which buckets carry byte sums the rollout side checks (trainer.weight_sync_verify:
    # every, first, off; posttrain.weight_sync.verify).
    verify: str = "first"

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    @abc.abstractmethod
    def run(self, source: WorkerGroup, target: WorkerGroup) -> dict[str, Any]:
        """Move every bucket once; return ``{"bytes": ..., "buckets": ...}``."""

    def close(self, source: WorkerGroup, target: WorkerGroup) -> None:  # noqa: B027
        """Release what the transport set up (default: nothing)."""


class InProcessTransport(WeightTransport):
    """Trainer and rollout roles live in the same rank processes (hybrid engine): one call per
    sync; on each rank the trainer's device tensors go straight into its rollout peer
    (:func:`posttrain.weight_sync.rank_side.hand_over`)."""

    name = "in_process"

    def run(self, source: WorkerGroup, target: WorkerGroup) -> dict[str, Any]:
        if not source.shares_processes_with(target):
            raise ValueError(
                f"the in_process transport needs {source.role} and {target.role} in the same "
                "processes (cluster.colocation: auto and equal device mappings)"
            )
        answers = source.call(
            "run_function", f"{RANK_SIDE}:hand_over", target.role, self.bucket_bytes, self.verify
        )
        return answers[0]


class SharedMemoryTransport(WeightTransport):
    """Buckets travel as shared-memory tensors through the driver (same host): one driver
    round trip per bucket, for engines that can take nothing else."""

    name = "shared_memory"

    def run(self, source: WorkerGroup, target: WorkerGroup) -> dict[str, Any]:
        source.call("export_begin", self.bucket_bytes, self.verify)
        total, count = 0, 0
        while True:
            bucket = source.call("export_next")[0]
            if bucket is None:
                break
            if bucket:
                target.call("import_weights", [bucket])
                total += bucket.nbytes
                count += 1
        return {"bytes": total, "buckets": count}


class BroadcastTransport(WeightTransport):
    """A torch.distributed broadcast from trainer rank 0 to every rollout rank (gloo on CPU,
    NCCL on GPU), over a process group made for the sync only. Both sides' loops run on the
    ranks (one driver call per group per sync, none per bucket), and the export of bucket k+1
    overlaps the broadcast of bucket k. The wire format is described in
    :mod:`posttrain.weight_sync.rank_side`; a rollout engine may join the group and receive the
    broadcasts in its own processes (``posttrain_weight_receiver``)."""

    name = "broadcast"
    # How long joining the group, and each collective in it, may wait for a peer; None: the
    # ranks' cluster.collective_timeout_s.
    timeout_s: float | None = None

    def __init__(self, bucket_bytes: int):
        super().__init__(bucket_bytes)
        self._joined = False

    def _join(self, source: WorkerGroup, target: WorkerGroup) -> None:
        # Trainer rank 0 hosts the store: its host's address, a port free there.
        addr = source.master_address()
        port = source.call("run_function", f"{RANK_SIDE}:free_port")[0]
        size = 1 + target.world_size
        # One name per group: engines that join the group themselves refuse a name twice.
        name = f"posttrain_weight_sync_{port}"
        fn = f"{RANK_SIDE}:join_sync_group"
        src = source.submit(
            "run_function",
            per_rank_args=[
                (fn, addr, port, 0 if r == 0 else -1, size, self.timeout_s, name)
                for r in range(source.world_size)
            ],
        )
        dst = target.submit(
            "run_function",
            per_rank_args=[
                (fn, addr, port, 1 + r, size, self.timeout_s, name)
                for r in range(target.world_size)
            ],
        )
        src.wait()
        dst.wait()
        self._joined = True

    def run(self, source: WorkerGroup, target: WorkerGroup) -> dict[str, Any]:
        if not self._joined:
            self._join(source, target)
        send = source.submit(
            "run_function", args=(f"{RANK_SIDE}:stream_send", self.bucket_bytes, self.verify)
        )
        recv = target.submit("run_function", args=(f"{RANK_SIDE}:stream_receive",))
        sent = send.wait()[0]
        received = recv.wait()
        return {**sent, "verified": sum(r.get("verified", 0) for r in received)}

    def close(self, source: WorkerGroup, target: WorkerGroup) -> None:
        if self._joined:
            source.call("run_function", f"{RANK_SIDE}:leave_sync_group")
            target.call("run_function", f"{RANK_SIDE}:leave_sync_group")
            self._joined = False
