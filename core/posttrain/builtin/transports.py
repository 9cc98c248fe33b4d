"""Built-in weight-sync transports and the default choice between them."""

from posttrain import hookimpl


@hookimpl(trylast=True)
def posttrain_add_weight_transports():
    from posttrain.weight_sync.transport import BroadcastTransport, SharedMemoryTransport

    return {"shared_memory": SharedMemoryTransport, "broadcast": BroadcastTransport}


@hookimpl(trylast=True)
def posttrain_select_weight_transport(source, target, colocated):
    # Colocated ranks share a host and its memory; otherwise a collective moves the weights.
    return "shared_memory" if colocated else "broadcast"
