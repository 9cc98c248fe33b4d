"""The core's weight sync, registered ``trylast``: its transports, the default choice between
them, the default sync (run the chosen transport), and the byte sums on exported buckets."""

from posttrain.markers import hookimpl


@hookimpl(trylast=True)
def posttrain_add_weight_transports():
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
def posttrain_select_weight_transport(source, target, colocated):
    # Roles in the same processes hand device tensors over; separate processes on the same
    # devices share the host's memory; otherwise a collective streams the weights.
    if source.shares_processes_with(target):
        return "in_process"
    return "shared_memory" if colocated else "broadcast"


@hookimpl(trylast=True)
def posttrain_sync_weights(source, target, transport):
    return transport.run(source, target)


@hookimpl(wrapper=True, trylast=True)
def posttrain_export_weights(worker, bucket_bytes, on_device):
    # The innermost wrapper: the sums are of the buckets as the engine made them, before any
    # other plugin's wrapper or the transport touches them (posttrain.weight_sync.verify).
    buckets = yield
    if buckets is None:
        return None
    from posttrain.weight_sync.verify import with_digests

    return with_digests(worker.sync, buckets)
