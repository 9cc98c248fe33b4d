"""The ``ddp_train`` strategy: an HF causal LM trained with plain torch DDP (every rank holds the
whole model; DDP all-reduces the gradients). The smallest complete trainer: the engine is
:mod:`posttrain_example_plugin.ddp_engine`, imported when a rank first needs it, so this
entry-point module stays cheap (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from posttrain import Capabilities, EngineHooks, ScoringOptions, StrategySpec, hookimpl

if TYPE_CHECKING:
    from posttrain import TrainEngine
    from posttrain_example_plugin import ddp_engine

    _ENGINE: TrainEngine = ddp_engine  # mypy: the engine defines every function it must, typed


@attrs.frozen(kw_only=True)
class DDPTrainConfig(ScoringOptions):
    """``strategy_config`` of ``ddp_train``: rows per forward pass (``micro_batch_size``,
    ``logprob_micro_batch_size``) and chunked log-probs (``logprob_chunk_tokens``) come from
    ScoringOptions; gradient checkpointing follows ``model_args.disable_gradient_checkpointing``."""


class DDPPlugin(EngineHooks):
    strategies = ("ddp_train",)
    engine = "posttrain_example_plugin.ddp_engine"

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name="ddp_train",
                config_class=DDPTrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    dtypes=("bf16", "fp32"),  # bf16 autocast needs no loss scaling; fp16 would
                    exports_hf_weights=True,
                    computes_logprobs=True,
                    shares_process=True,  # all state in worker.engine_state, any default group
                ),
                description="training (actor) with torch DistributedDataParallel",
            )
        ]


plugin = DDPPlugin()
