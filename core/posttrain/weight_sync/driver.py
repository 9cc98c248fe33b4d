"""The weight-sync phase on the driver: pick the transport once, then run a sync after every
update (``posttrain_sync_weights``, which plugins may wrap)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.errors import UserError

if TYPE_CHECKING:
    import pluggy

    from posttrain.launch.base import WorkerGroup
    from posttrain.weight_sync.transport import WeightTransport


def make_transport(
    hook: pluggy.HookRelay,
    train: WorkerGroup,
    infer: WorkerGroup,
    bucket_bytes: int,
    verify: str = "first",
) -> WeightTransport:
    """The transport ``posttrain_select_weight_transport`` names, among those declared, checking
    the buckets ``verify`` names (trainer.weight_sync_verify)."""
    name = hook.posttrain_select_weight_transport(
        source=train, target=infer, colocated=train.shares_devices_with(infer)
    )
    transports: dict[str, type[WeightTransport]] = {}
    for mapping in hook.posttrain_add_weight_transports():
        transports.update(mapping or {})
    if name not in transports:
        raise UserError(
            f"weight transport '{name}' is not provided by any plugin "
            f"(available: {', '.join(sorted(transports))})"
        )
    transport = transports[name](bucket_bytes=bucket_bytes)
    transport.verify = verify
    return transport


def sync_weights(
    hook: pluggy.HookRelay, train: WorkerGroup, infer: WorkerGroup, transport: WeightTransport
) -> dict[str, float]:
    """Move the trainer's weights to the rollout role; the sync's figures (``bytes``, ...)."""
    return hook.posttrain_sync_weights(source=train, target=infer, transport=transport) or {}
