"""What a LoRA policy's weight syncs carry (``model_args.lora.sync``): checked with the
workflow, then resolved before any process starts, so strategies only ever see ``adapter`` or
``merged``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from posttrain.config.report import ErrorReport, join_path

if TYPE_CHECKING:
    from posttrain.config.sections import Workflow
    from posttrain.host.strategy import StrategySpec


def check_lora_sync(wf: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport) -> None:
    """``sync: adapter`` needs a rollout strategy that applies adapters over its own base."""
    lora = wf.actor_train.model_args.lora if wf.actor_train is not None else None
    spec = _rollout_spec(wf, strategies)
    if lora is None or lora.sync != "adapter" or spec is None:
        return
    if not spec.capabilities.lora_adapter_sync:
        able = sorted(n for n, s in strategies.items() if s.capabilities.lora_adapter_sync)
        report.error(
            join_path("actor_train", "model_args", "lora", "sync"),
            f"'adapter', but actor_infer's strategy '{spec.name}' does not take adapter-only "
            "weight syncs",
            f"set sync: merged (or auto, which picks merged for it); rollout strategies that "
            f"take adapters: {', '.join(able) or 'none installed'}",
        )


def resolve_lora_sync(wf: Workflow, strategies: dict[str, StrategySpec]) -> Workflow:
    """``wf`` with actor_train's ``lora.sync: auto`` resolved (adapter where actor_infer's
    strategy takes adapters, merged elsewhere), and actor_infer's ``model_args.lora`` set to the
    adapters its syncs carry, or None when they carry whole weights
    (:func:`posttrain.backend.synced_adapter` reads it)."""
    train = wf.actor_train
    lora = train.model_args.lora if train is not None else None
    if train is None or lora is None or wf.actor_infer is None:
        return wf
    spec = _rollout_spec(wf, strategies)
    mode = lora.sync
    if mode == "auto":
        takes = spec is not None and spec.capabilities.lora_adapter_sync
        mode = "adapter" if takes else "merged"
    resolved = attrs.evolve(lora, sync=mode)
    infer = wf.actor_infer
    return attrs.evolve(
        wf,
        actor_train=attrs.evolve(train, model_args=attrs.evolve(train.model_args, lora=resolved)),
        actor_infer=attrs.evolve(
            infer,
            model_args=attrs.evolve(infer.model_args, lora=resolved if mode == "adapter" else None),
        ),
    )


def _rollout_spec(wf: Workflow, strategies: dict[str, StrategySpec]) -> StrategySpec | None:
    infer = wf.actor_infer
    return strategies.get(infer.strategy_args.strategy_name) if infer is not None else None
