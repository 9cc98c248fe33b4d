"""The ``hf_infer`` strategy: rollout and log-probs on plain transformers (the reference backend).

This module is cheap to import; the engine code lives in :mod:`posttrain_hf_infer.engine` and is
imported by the worker hooks (from :class:`posttrain.EngineHooks`) when a rank first
needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from posttrain import Capabilities, EngineHooks, ScoringOptions, StrategySpec, at_least, hookimpl
from posttrain.backend import (
    MemoryQuery,
    ReleaseKnob,
    RoleMemory,
    forward_working_bytes,
    logit_bytes,
    release_knobs,
)

if TYPE_CHECKING:
    from posttrain import ErrorReport, RolloutEngine, Workflow
    from posttrain_hf_infer import engine

    _ENGINE: RolloutEngine = engine  # mypy: the engine defines every function it must, typed

# Bytes of a float32 (the sampling step's probabilities).
FLOAT32 = 4
STRATEGY = "hf_infer"


@attrs.frozen(kw_only=True)
class HFInferConfig(ScoringOptions):
    """``strategy_config`` of ``hf_infer``.

    Scoring (log-probs, reward-model scores) runs ``logprob_micro_batch_size`` or
    ``micro_batch_size`` rows a forward pass when one is set, else as generation does (the
    role's ``infer_batch_size``, else ``batch_size``).
    """

    # Prompts per forward pass when generating or scoring (the role's infer_batch_size wins).
    batch_size: int = attrs.field(default=64, validator=at_least(1))
    # How tokens are decoded: "dynamic" (transformers' growing KV cache, as generate: a new
    # shape every step), "static" (a preallocated cache and a fixed-shape step), "cuda_graph"
    # (static, with the step captured in a CUDA graph once per shape bucket and replayed;
    # static where there is no GPU), "compiled" (cuda_graph with the step through
    # torch.compile first and plain sampling fused: the fastest, after a compile at the first
    # generation, 2 minutes at 1.5B, which that generation waits for). "auto": on a GPU,
    # cuda_graph while the compiled step is built on a background thread, then compiled from
    # the generation after it is ready (the first rollout waits for no compile); dynamic on
    # the CPU.
    decode: Literal["auto", "dynamic", "static", "cuda_graph", "compiled"] = "auto"
    # In the fixed-shape modes (static, cuda_graph, compiled), a row whose sample ended takes
    # the next prompt while the others go on (continuous batching); off, or with "dynamic",
    # a batch of rows runs until its longest sample ends.
    continuous_batching: bool = True
    # In the fixed-shape modes, a layer's q/k/v projections and its MLP's gate/up projections
    # each run as one GEMM over their weights stacked into one tensor (the parameters become
    # views of it; names and weight syncs unchanged); off: one GEMM per projection, as
    # transformers runs them.
    fuse_projections: bool = True
    # In the fixed-shape modes on a GPU, the kernel of the one-token steps' attention:
    # "triton" (posttrain's: each KV head read once for the query heads sharing it, no slot
    # after a row's last visible one; Ampere or later, bf16/fp16, head size a power of two),
    # "cudnn" (cuDNN's fused kernel, wherever torch says it serves: Ampere or later,
    # bf16/fp16), "sdpa" (grouped SDPA, as for the prompts, and wherever the chosen kernel does
    # not serve). "auto": triton with many rows (from 1.5 rows x KV heads per streaming
    # multiprocessor: about 100 rows of 2 KV heads on an H200), cudnn with fewer (it reads faster
    # then), chosen per batch of rows from one compile; where only one serves, that one.
    decode_attention: Literal["auto", "triton", "cudnn", "sdpa"] = "auto"
    # Move the weights to host memory while another role on the same GPUs runs (a KV cache
    # lives only during a generation); off, they stay on the device; auto: on where the memory
    # plan needs it (`posttrain plan` says which).
    param_offload: ReleaseKnob = "auto"
    # Ranks a replica spans, for a model one GPU cannot hold: ranks [k*N, (k+1)*N) of the
    # role's device_mapping hold replica k, its layers split by transformers' tensor-parallel
    # plan (`tp_plan`, DTensor). Such a replica decodes with the dynamic cache and scores from
    # full logits; its weights stay on the device (no param_offload).
    tensor_parallel_size: int = attrs.field(default=1, validator=at_least(1))


class HFInferPlugin(EngineHooks):
    strategies = (STRATEGY,)
    engine = "posttrain_hf_infer.engine"

    @hookimpl(trylast=True)
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=STRATEGY,
                config_class=HFInferConfig,
                capabilities=Capabilities(
                    kind="rollout",
                    parallel_dims=("tensor_parallel_size",),
                    import_transports=("in_process", "shared_memory", "broadcast"),
                    stop_strings=True,
                    shares_process=True,
                    heads=("lm", "score"),
                    routing_replay=True,
                    lora_adapter_sync=True,
                ),
                description="generation, log-probs and reward-model scores with plain "
                "transformers (the reference backend)",
            )
        ]

    @hookimpl(trylast=True)
    def posttrain_validate_workflow(
        self, workflow: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
    ) -> None:
        for name, role in workflow.roles().items():
            config = role.strategy_args.strategy_config
            if role.strategy_args.strategy_name != STRATEGY or not isinstance(
                config, HFInferConfig
            ):
                continue
            if config.tensor_parallel_size == 1:
                continue
            path = f"{name}.strategy_args.strategy_config"
            if name in ("reward", "critic"):
                report.error(
                    f"{path}.tensor_parallel_size",
                    f"hf_infer splits only a causal LM over ranks, not the {name}'s head",
                    "tensor_parallel_size: 1",
                )
            if config.param_offload is True:
                report.error(
                    f"{path}.param_offload",
                    "a tensor-parallel hf_infer replica keeps its weights on the device",
                    "param_offload: false (or auto), or tensor_parallel_size: 1",
                )
            train = workflow.actor_train
            lora = train.model_args.lora if train is not None else None
            if name == "actor_infer" and lora is not None and lora.sync != "merged":
                # auto resolves to adapter for hf_infer (Capabilities.lora_adapter_sync).
                report.error(
                    f"{path}.tensor_parallel_size",
                    "a tensor-parallel hf_infer replica takes whole weights, not the adapters "
                    f"alone (actor_train.model_args.lora.sync: {lora.sync})",
                    "actor_train.model_args.lora.sync: merged, or tensor_parallel_size: 1",
                )

    @hookimpl(trylast=True)
    def posttrain_estimate_memory(self, query: MemoryQuery) -> RoleMemory | None:
        if query.role.strategy_args.strategy_name != STRATEGY:
            return None
        return estimate_memory(query)


def estimate_memory(query: MemoryQuery) -> RoleMemory:
    """One replica a GPU (or ``tensor_parallel_size`` GPUs, each a share): the model in
    ``model_args.dtype``; the rollout's fixed-shape decoders keep their KV cache (batch rows x
    prompt + new tokens) from one step to the next; a scoring role (reference, reward) works a
    micro-batch at a time."""
    g, b, cfg, work = query.geometry, query.dtype_bytes, query.config, query.workload
    tp = cfg.tensor_parallel_size
    path = f"{query.role_name}.strategy_args.strategy_config"
    resident = {"weights": g.params * b // tp}
    knobs = [
        f"{path}.param_offload: true (the weights wait in host memory while others run)"
        if tp == 1
        else f"{path}.tensor_parallel_size: more ranks a replica (each holds a smaller share)"
    ]
    rows = query.role.infer_batch_size or cfg.batch_size
    if query.role_name == "actor_infer":
        # A batch of prompts decodes every sample of each at once: its rows are its prompts
        # times the samples a prompt (work.rows / work.prompts), at most a replica's share.
        rows = min(rows * work.samples_per_prompt, -(-work.rows * tp // query.gpus))
        kv_cache = rows * work.sequence_tokens * g.kv_cache_bytes_per_token(b) // tp
        fixed_shape = cfg.decode != "dynamic" and query.device == "cuda" and tp == 1
        step = {
            "prefill": forward_working_bytes(g, rows * work.prompt_tokens, b),
            "sampling": 2 * rows * g.vocab_size * FLOAT32,
        }
        if fixed_shape:
            resident["kv_cache"] = kv_cache
        else:
            step["kv_cache"] = kv_cache
        phases = {"rollout": step}
        knobs.append(f"{query.role_name}.infer_batch_size: fewer rows decode at once (KV cache)")
    else:
        tokens = (cfg.scoring_rows() or rows) * work.sequence_tokens
        phases = {
            "logprobs": {
                "forward": forward_working_bytes(g, tokens, b),
                "logits": logit_bytes(g, tokens, cfg.logprob_chunk_tokens, b, training=False),
            }
        }
        knobs.append(f"{query.role_name}.infer_batch_size: fewer rows a forward pass")
    released, auto = release_knobs(cfg, {"param_offload": resident} if tp == 1 else {})
    return RoleMemory(
        resident=resident,
        phases=phases,
        released=released,
        knobs=tuple(knobs),
        auto_release=auto,
    )


plugin = HFInferPlugin()
