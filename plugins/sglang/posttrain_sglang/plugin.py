"""The ``sglang`` strategy: rollout (generation with per-token log-probs) on SGLang.

This module is cheap to import (no torch, no SGLang): ``posttrain validate``, ``posttrain plugins``
and ``posttrain doctor`` load it. The worker hooks (from :class:`posttrain.host.engine_hooks.
EngineHooks`) import :mod:`posttrain_sglang.engine` when a rank of this strategy first needs it;
SGLang itself is imported only there.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain import Capabilities, EngineHooks, EnvCheck, StrategySpec, at_least, between, hookimpl

STRATEGY = "sglang"
# The SGLang versions this plugin is tested with (checked by `posttrain doctor`).
TESTED_SGLANG = ">=0.5.23,<0.5.24"

DtypeName = Literal["auto", "fp32", "bf16", "fp16"]


@attrs.frozen(kw_only=True)
class SGLangConfig:
    """``strategy_config`` of ``sglang``; every field maps to one of SGLang's ``ServerArgs``.

    ``None`` means SGLang's own default, except where noted. Anything else SGLang accepts goes in
    ``engine_kwargs``; it is checked against SGLang's ``ServerArgs`` when the engine starts.
    The engine is SGLang's in-process ``Engine``: its scheduler runs in child processes of the
    rank that drives it.
    """

    # GPUs per engine (SGLang tensor parallelism); data-parallel replicas = ranks / this.
    tp_size: int = attrs.field(default=1, validator=at_least(1))
    # Share of each GPU's memory for weights + KV cache. GPU only.
    mem_fraction_static: float | None = attrs.field(
        default=None, validator=between(0, 1, low_open=True, high_open=True)
    )
    # KV-cache size in tokens; None: 4096 on CPU (uncapped SGLang takes ~15 GB there), and
    # mem_fraction_static on GPU.
    max_total_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    # None: "torch_native" on CPU, SGLang's choice on GPU.
    attention_backend: str | None = None
    # Weight dtype in the engine; None: the role's model_args.dtype.
    dtype: DtypeName | None = None
    # Longest prompt + response; None: the model's max_position_embeddings.
    context_length: int | None = attrs.field(default=None, validator=at_least(1))
    # Engine seed; None: the run's seed. (Requests carry a sampling seed too, which SGLang
    # honours only with engine_kwargs {enable_deterministic_inference: true}.)
    random_seed: int | None = None
    # "cpu" or "cuda"; None: the role's device.
    device: Literal["cpu", "cuda"] | None = None
    # Release/resume memory for colocated roles (torch_memory_saver); None: on with GPUs, off on
    # CPU (SGLang does not release memory there).
    enable_memory_saver: bool | None = None
    # Any other SGLang ServerArgs field, passed through unchanged.
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict)


class SGLangPlugin(EngineHooks):
    """Worker hooks call :mod:`posttrain_sglang.engine` (imported on first use)."""

    strategies = (STRATEGY,)
    engine = "posttrain_sglang.engine"

    @hookimpl
    def posttrain_add_strategies(self):
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
    def posttrain_environment_checks(self):
        return [EnvCheck(plugin="posttrain-sglang", package="sglang", tested=TESTED_SGLANG)]


plugin = SGLangPlugin()
