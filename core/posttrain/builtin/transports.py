"""Built-in weight-sync transports and the default choice between them."""

from posttrain import hookimpl


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
