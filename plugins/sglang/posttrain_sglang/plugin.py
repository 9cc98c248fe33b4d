"""The ``sglang`` strategy: rollout (generation with per-token log-probs) on SGLang.

This module is cheap to import (no torch, no SGLang): ``posttrain validate``, ``posttrain plugins``
and ``posttrain doctor`` load it. The worker hooks (from :class:`posttrain.host.engine_hooks.
EngineHooks`) import :mod:`posttrain_sglang.engine` when a rank of this strategy first needs it;
SGLang itself is imported only there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain import Capabilities, EngineHooks, EnvCheck, StrategySpec, hookimpl
from posttrain_sglang.config import SGLangConfig

if TYPE_CHECKING:
    from posttrain import RolloutEngine
    from posttrain_sglang import engine

    _ENGINE: RolloutEngine = engine  # mypy: the engine defines every function it must, typed

STRATEGY = "sglang"
# The SGLang versions this plugin is tested with (checked by `posttrain doctor`).
TESTED_SGLANG = ">=0.5.23,<0.5.24"


class SGLangPlugin(EngineHooks):
    """Worker hooks call :mod:`posttrain_sglang.engine` (imported on first use)."""

    strategies = (STRATEGY,)
    engine = "posttrain_sglang.engine"

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=STRATEGY,
                config_class=SGLangConfig,
                capabilities=Capabilities(
                    kind="rollout",
                    parallel_dims=("tp_size",),
                    import_transports=("in_process", "shared_memory", "broadcast"),
                    computes_logprobs=True,
                    stop_strings=True,  # SamplingParams.stop goes to SGLang's `stop`
                    # The engine's schedulers are child processes of their own; the rank only
                    # drives them, so it can live beside a trainer.
                    shares_process=True,
                ),
                description="rollout with SGLang (weights from tensors or a broadcast group)",
            )
        ]

    @hookimpl
    def posttrain_environment_checks(self) -> list[EnvCheck]:
        return [EnvCheck(plugin="posttrain-sglang", package="sglang", tested=TESTED_SGLANG)]


plugin = SGLangPlugin()
