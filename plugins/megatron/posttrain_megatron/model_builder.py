"""Process groups, model chunks and optimizer of a megatron rank."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from posttrain.backend import (
    collective_timeout_s,
    init_default_process_group,
    is_cuda,
    lora_args,
    resolve_model_path,
    torch_dtype,
)
from posttrain_megatron import token_scores
from posttrain_megatron.wrappers import inner_optimizers, unwrap

if TYPE_CHECKING:
    from collections.abc import Callable

    from megatron.core.optimizer import MegatronOptimizer
    from transformers import PretrainedConfig

    from posttrain import WorkerContext
    from posttrain_megatron.config import MegatronParallelConfig

log = logging.getLogger(__name__)

TRAIN = "megatron_train"


# The layout megatron-core's parallel state was set up with in this process (it is one per
# process, as megatron-core's own state is).
_PROCESS_LAYOUT: dict[str, int | None] = {}


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from posttrain_megatron import cpu_support, mcore_compat

    init_default_process_group(worker.device)
    if not is_cuda(worker):
        cpu_support.apply()
    mcore_compat.apply()
    cfg = worker.config
    layout = {
        "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": cfg.virtual_pipeline_model_parallel_size,
        "context_parallel_size": cfg.context_parallel_size,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
        "expert_tensor_parallel_size": cfg.expert_tensor_parallel_size,
    }
    if _PROCESS_LAYOUT:
        # Another megatron role of this process (hybrid engine) set the layout up; the plan
        # only puts roles of one layout together (plugin.split_by_layout).
        if layout != _PROCESS_LAYOUT:
            raise RuntimeError(
                f"megatron: role {worker.role} needs layout {layout} but this process already "
                f"runs {_PROCESS_LAYOUT}; use cluster.colocation: separate"
            )
    else:
        # Its groups time out as the default group does (cluster.collective_timeout_s).
        minutes = max(1, math.ceil(collective_timeout_s() / 60))
        ps.initialize_model_parallel(**layout, distributed_timeout_minutes=minutes)
        model_parallel_cuda_manual_seed(worker.seed)
        _PROCESS_LAYOUT.update(layout)
    return {
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
    }


def attention_backend(requested: str) -> str:
    from posttrain_megatron.layer_spec import have_transformer_engine

    if requested == "auto":
        return "transformer_engine" if have_transformer_engine() else "sdpa"
    return requested


def transformer_overrides(worker: WorkerContext, hf_config: PretrainedConfig) -> dict[str, Any]:
    """TransformerConfig fields set from the strategy config (user overrides win last)."""
    cfg = worker.config
    cpu = not is_cuda(worker)
    out: dict[str, Any] = {
        # Nothing to split at TP1 (validation notes it; Megatron-LM does the same).
        "sequence_parallel": cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1,
        "moe_grouped_gemm": cfg.moe_grouped_gemm,
        # Shapes travel with activations between pipeline stages (micro-batches vary in length).
        "variable_seq_lengths": cfg.pipeline_model_parallel_size > 1,
        # The schedule averages losses over micro-batches unless told otherwise; core's loss is
        # already each micro-batch's share of the step (see train_step).
        "calculate_per_token_loss": False,
        # Fused kernels that need CUDA / TE / apex; torch's own ops otherwise.
        "masked_softmax_fusion": not cpu and cfg.attention_backend == "transformer_engine",
        # megatron's own fused SwiGLU / bias-dropout-add (torch.compile / jit, no TE needed).
        "bias_activation_fusion": not cpu,
        "bias_dropout_fusion": not cpu,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "use_cpu_initialization": cpu,
    }
    if _num_experts(hf_config):
        # (megatron-core rejects allgather with variable sequence lengths even for dense models)
        out["moe_token_dispatcher_type"] = cfg.moe_token_dispatcher_type
    norm_topk = getattr(hf_config, "norm_topk_prob", None)
    if norm_topk is not None:
        # HF renormalises the top-k router weights iff norm_topk_prob; megatron does so iff the
        # softmax runs after the top-k (pre_softmax False).
        out["moe_router_pre_softmax"] = not norm_topk
    out.update(recompute_fields(worker))
    if cfg.moe_token_dispatcher_type == "alltoall" and cpu and _num_experts(hf_config):
        raise ValueError(
            "megatron: the alltoall MoE token dispatcher needs CUDA events; on CPU set "
            "moe_token_dispatcher_type: allgather"
        )
    out.update(cfg.override_transformer_config)
    return out


def recompute_fields(worker: WorkerContext) -> dict[str, Any]:
    """Activation recompute: the strategy config's settings (its ``recompute_*`` fields,
    ``moe_layer_recompute`` or ``recompute_*`` keys of ``override_transformer_config``), else,
    for a trainer, ``model_args.disable_gradient_checkpointing: false`` as the other trainers
    read it: every layer recomputed in backward (``full``, ``uniform``, one layer per
    checkpoint), so only each layer's input, [tokens, hidden], stays from forward."""
    cfg = worker.config
    granularity = getattr(cfg, "recompute_granularity", None)
    moe_layers = getattr(cfg, "moe_layer_recompute", False)
    explicit = (
        granularity
        or moe_layers
        or any(key.startswith("recompute") for key in cfg.override_transformer_config)
    )
    asked = worker.strategy_name == TRAIN and not worker.model_args.disable_gradient_checkpointing
    if asked and not explicit:
        granularity = "full"
    out: dict[str, Any] = {}
    if granularity:
        out["recompute_granularity"] = granularity
        if granularity == "full":
            out["recompute_method"] = getattr(cfg, "recompute_method", None) or "uniform"
            out["recompute_num_layers"] = getattr(cfg, "recompute_num_layers", None) or 1
    if moe_layers:
        out["recompute_modules"] = ["moe"]
        out.setdefault("recompute_granularity", "selective")
    return out


def _num_experts(hf_config: PretrainedConfig) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


def build_models(worker: WorkerContext) -> tuple[list[torch.nn.Module], Any]:
    """Model chunks (one per virtual pipeline stage) with their weights, and the bridge."""
    from transformers import AutoConfig

    cfg = worker.config
    path = resolve_model_path(worker.model_args.model_name_or_path, worker.base_dir)
    hf_config = AutoConfig.from_pretrained(path)
    dtype = torch_dtype(worker.model_args.dtype)
    adapters = lora_args(worker, TRAIN) is not None
    # LoRA adapts megatron-core's own parallel linears, which TransformerEngine's spec replaces
    # (norms fused in): auto picks the SDPA spec for it.
    requested = "sdpa" if adapters and cfg.attention_backend == "auto" else cfg.attention_backend
    backend = attention_backend(requested)
    if cfg.pack_sequences and backend != "sdpa":
        # attention_backend: auto picked TransformerEngine (validation saw only the setting).
        raise ValueError(
            f"megatron: pack_sequences runs on the SDPA attention spec, not {backend!r}; "
            "set attention_backend: sdpa"
        )
    value = worker.head == "value"
    bridge, callbacks = _make_bridge(
        cfg, hf_config, dtype, backend, transformer_overrides(worker, hf_config), value
    )
    # Pad the vocabulary to split over TP ranks; the padding columns are left out (token_scores).
    bridge.make_vocab_size_divisible_by = cfg.tensor_model_parallel_size
    train = worker.strategy_name == TRAIN
    from posttrain_megatron import lora

    if adapters:
        callbacks = [*callbacks, lora.model_creation_callback(worker)]
    ddp_config = None
    if train:
        ddp_config = {
            "use_distributed_optimizer": cfg.use_distributed_optimizer,
            "overlap_grad_reduce": cfg.overlap_grad_reduce,
            "overlap_param_gather": cfg.overlap_param_gather,
            # As Megatron-LM's default: grads accumulate in the model dtype, the optimizer
            # steps fp32 main params (fp32 grad buffers cost a copy and bandwidth per step).
            "grad_reduce_in_fp32": dtype == torch.float32,
        }
    models = bridge.get_model(
        wrap_with_ddp=train,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not is_cuda(worker),
        data_parallel_random_init=False,
        ddp_config=ddp_config,
        post_model_creation_callbacks=callbacks,
    )
    # The bridges walk megatron's base parameters: the adapters (their own init) stay out.
    with lora.detached(models) if adapters else contextlib.nullcontext():
        if cfg.use_dist_checkpointing:
            from posttrain_megatron.checkpointing import load_model_weights

            load_model_weights(models, worker.resolve_path(cfg.dist_checkpointing_path))
        else:
            bridge.load_weights([unwrap(m) for m in models], path)
    for model in models:
        if not value:
            # Called with labels, the model scores next tokens instead of a language-model loss.
            token_scores.install(unwrap(model), bridge.vocab_size, cfg.logprob_chunk_tokens)
        model.train(train)
        if not train:
            for p in model.parameters():
                p.requires_grad_(False)
    return models, bridge


def _make_bridge(
    cfg: MegatronParallelConfig,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    backend: str,
    overrides: dict[str, Any],
    value: bool,
) -> tuple[Any, list[Callable[..., None]]]:
    """The bridge and its model-creation callbacks: mbridge when the role asks for it, else the
    plugin's own dense converter. A model that converter does not cover (MoE) still builds
    through mbridge when its weights come from a dist checkpoint (``posttrain convert``); without
    one, DenseBridge says why it cannot load it. A critic (``value``) gets the value head
    (:mod:`posttrain_megatron.value_head`) with either."""
    from posttrain_megatron.dense_models import unsupported_reason

    callbacks: list[Callable[..., None]] = []
    if value:
        from posttrain_megatron import value_head

        hf_config = value_head.bridge_hf_config(hf_config)
        callbacks = list(value_head.MODEL_CREATION_CALLBACKS)
    if cfg.use_mbridge or (cfg.use_dist_checkpointing and unsupported_reason(hf_config)):
        from posttrain_megatron.bridge import make_bridge

        mixins = (value_head.ValueHeadNames,) if value else ()
        return make_bridge(hf_config, dtype, backend, overrides, mixins=mixins), callbacks
    from posttrain_megatron.dense_bridge import DenseBridge

    return DenseBridge(hf_config, dtype, backend, overrides, value_head=value), callbacks


def build_optimizer(worker: WorkerContext, models: list[torch.nn.Module]) -> MegatronOptimizer:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    cfg, args = worker.config, worker.training_args
    if args is None:
        raise ValueError(f"role {worker.role}: megatron_train needs training_args")
    dtype = torch_dtype(worker.model_args.dtype)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=args.learning_rate,
        min_lr=0.0,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_epsilon,
        clip_grad=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        optimizer_cpu_offload=cfg.optimizer_offload,
        optimizer_offload_fraction=cfg.optimizer_offload_fraction if cfg.optimizer_offload else 0.0,
        use_precision_aware_optimizer=cfg.optimizer_offload,
    )
    optimizer = get_megatron_optimizer(optimizer_config, models)
    if is_cuda(worker) and not cfg.optimizer_offload:
        _use_fused_adam(optimizer)
    model_config = get_model_config(models[0])
    model_config.finalize_model_grads_func = finalize_model_grads
    if cfg.overlap_grad_reduce:
        no_sync = [m.no_sync for m in models]
        model_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if cfg.overlap_param_gather and cfg.use_distributed_optimizer:
        sync = [m.start_param_sync for m in models]
        model_config.param_sync_func = sync[0] if len(sync) == 1 else sync
    if optimizer_config.fp16:
        model_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def _use_fused_adam(optimizer: MegatronOptimizer) -> None:
    """Without apex / TransformerEngine megatron-core falls back to torch's Adam(W) with the
    foreach implementation; torch's fused CUDA kernel is ~3x faster on the same state."""
    for inner in inner_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
