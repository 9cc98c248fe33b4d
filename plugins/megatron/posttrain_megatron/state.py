"""A megatron role's engine objects between calls: one typed object a role,
``worker.engine_state(MegatronState)``. ``worker.model`` is the list of model chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.optimizer import MegatronOptimizer

    from posttrain.backend import BackgroundSave, HostBuffers, OldPolicyRouting


def _old_policy_routing() -> OldPolicyRouting:
    from posttrain.backend import OldPolicyRouting

    return OldPolicyRouting()


@attrs.define(kw_only=True)
class MegatronState:
    # The HF <-> megatron weight bridge (mbridge's, or this plugin's dense one): no common type.
    bridge: Any = None
    vocab_size: int | None = None
    # Train steps taken, and the optimizer updates among them (megatron skips an update on a
    # non-finite grad norm): the LR schedule follows steps, Adam's step count updates.
    step: int = 0
    updates: int = 0
    # megatron-core's (distributed, possibly chained) optimizer; None for megatron_infer.
    optimizer: MegatronOptimizer | None = None
    lr_multiplier: Callable[[int], float] | None = None
    # Background checkpoint saves: the reused host copies, and the save in flight with
    # megatron's async request (whose finalisation is collective).
    checkpoint_buffers: HostBuffers | None = None
    background_save: tuple[BackgroundSave, AsyncRequest] | None = None
    # routing_replay: old_policy: the old-policy pass's routing, until the update replays it.
    old_routing: OldPolicyRouting = attrs.field(factory=_old_policy_routing)
