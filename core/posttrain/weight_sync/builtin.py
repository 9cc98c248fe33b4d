"""The core's weight sync, registered ``trylast``: its transports, the default choice between
them, the default sync (run the chosen transport), and the byte sums on exported buckets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.markers import hookimpl

if TYPE_CHECKING:
    from collections.abc import Generator, Iterator

    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import WeightBucket
    from posttrain.weight_sync.transport import WeightTransport


@hookimpl(trylast=True)
def posttrain_add_weight_transports() -> dict[str, type[WeightTransport]]:
    from posttrain.weight_sync.transport import (
        BroadcastTransport,
        InProcessTransport,
        SharedMemoryTransport,
    )

    return {
        "in_process": InProcessTransport,
        "shared_memory": SharedMemoryTransport,
        "broadcast": BroadcastTransport,
    }


@hookimpl(trylast=True)
def posttrain_select_weight_transport(
    source: WorkerGroup, target: WorkerGroup, colocated: bool
) -> str:
    # Roles in the same processes hand device tensors over; separate processes on the same
    # devices share the host's memory; otherwise a collective streams the weights.
    if source.shares_processes_with(target):
        return "in_process"
    return "shared_memory" if colocated else "broadcast"


@hookimpl(trylast=True)
def posttrain_sync_weights(
    source: WorkerGroup, target: WorkerGroup, transport: WeightTransport
) -> dict[str, Any]:
    return transport.run(source, target)


@hookimpl(wrapper=True, trylast=True)
def posttrain_export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool
) -> Generator[None, Iterator[WeightBucket] | None, Iterator[WeightBucket] | None]:
    # The innermost wrapper: the sums are of the buckets as the engine made them, before any
    # other plugin's wrapper or the transport touches them (posttrain.weight_sync.verify).
    buckets = yield
    if buckets is None:
        return None
    from posttrain.weight_sync.verify import with_digests

    return with_digests(worker.sync, buckets)
