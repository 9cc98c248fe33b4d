"""``posttrain validate`` checks of megatron roles (driver side; no torch, no megatron import).

Core already checks that the role's device count divides by TP x PP x CP (the data-parallel size
is what remains). Here: layout against the model's shape, sequence parallelism, expert sizes,
``override_transformer_config`` keys against megatron-core's TransformerConfig, and a way to load
the weights (mbridge, a dist checkpoint, or the plugin's dense converter for a dense model).
"""

from __future__ import annotations

import json
import os
from typing import Any

from posttrain import ErrorReport, did_you_mean, join_path
from posttrain.backend import PRESETS, is_preset
from posttrain_megatron.config import MegatronInferConfig, MegatronParallelConfig
from posttrain_megatron.dense_models import unsupported_reason
from posttrain_megatron.transformer_fields import transformer_config_fields

# Set by the plugin from the layout keys; overriding them would desynchronise the two.
_LAYOUT_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
)


# LoRA: megatron's linear under a decoder layer -> the HF projections (under a layer) it fuses,
# in the order of its weight's layout (posttrain_megatron.dense_mapping).
LORA_MODULES: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}


def lora_target_problem(target_modules: list[str]) -> tuple[str, str] | None:
    """``(problem, hint)`` when ``model_args.lora.target_modules`` cannot be adapted on
    megatron's fused linears: a name that is not a decoder layer's projection, or part of a
    fused linear (q_proj alone: the linear's one adapter serves q, k and v)."""
    wanted = set(target_modules)
    known = {hf.rsplit(".", 1)[-1] for hfs in LORA_MODULES.values() for hf in hfs}
    unknown = sorted(wanted - known)
    if unknown:
        return (
            f"{', '.join(unknown)}: megatron_train adapts only the linears of its decoder layers",
            f"name among {', '.join(sorted(known))}",
        )
    for module, hfs in LORA_MODULES.items():
        names = [hf.rsplit(".", 1)[-1] for hf in hfs]
        chosen = [n for n in names if n in wanted]
        if chosen and len(chosen) < len(names):
            return (
                f"{', '.join(chosen)} without {', '.join(n for n in names if n not in wanted)}: "
                f"megatron fuses {', '.join(names)} into one linear ({module}) whose one "
                "adapter serves them all",
                f"name all of {', '.join(names)} or none",
            )
    return None


def lora_targets(target_modules: list[str]) -> list[str]:
    """The megatron linears (under a layer) that ``target_modules`` adapt (checked first with
    :func:`lora_target_problem`)."""
    wanted = set(target_modules)
    return [
        module
        for module, hfs in LORA_MODULES.items()
        if any(hf.rsplit(".", 1)[-1] in wanted for hf in hfs)
    ]


def check_lora(
    role_name: str, lora: Any, config: MegatronParallelConfig, report: ErrorReport
) -> None:
    """What megatron_train's adapters (posttrain_megatron.lora) do not cover, refused before
    any process starts; ``lora`` is the role's ``model_args.lora``."""
    where = join_path(role_name, "model_args", "lora")
    problem = lora_target_problem(list(lora.target_modules))
    if problem is not None:
        report.error(f"{where}.target_modules", *problem)
    if lora.dropout:
        report.error(
            f"{where}.dropout", "megatron_train's adapters have no dropout", "set dropout: 0"
        )
    strategy = join_path(role_name, "strategy_args", "strategy_config")
    if config.attention_backend == "transformer_engine":
        report.error(
            f"{strategy}.attention_backend",
            "megatron_train's LoRA adapts megatron-core's parallel linears; TransformerEngine's "
            "layer spec replaces them",
            "use attention_backend: auto or sdpa (auto picks sdpa with LoRA)",
        )
    if getattr(config, "use_distributed_optimizer", False):
        report.error(
            f"{strategy}.use_distributed_optimizer",
            "megatron_train checkpoints its adapters' optimizer state per rank; the adapters "
            "are small enough not to shard it",
            "set use_distributed_optimizer: false",
        )


def model_shape(model_path: str | None, base_dir: str) -> dict[str, Any] | None:
    """The HF config fields the checks need, from a preset or a local config.json."""
    if not model_path:
        return None
    if is_preset(model_path):
        preset = PRESETS.get(model_path.split(":", 1)[1])
        if preset is None:
            return None
        return {
            "model_type": preset.arch,
            "num_attention_heads": preset.num_attention_heads,
            "num_key_value_heads": preset.num_key_value_heads,
            "num_hidden_layers": preset.num_hidden_layers,
            "num_experts": preset.num_experts,  # 0 for a dense preset
        }
    local = model_path if os.path.isabs(model_path) else os.path.join(base_dir, model_path)
    config_file = os.path.join(local, "config.json")
    if not os.path.exists(config_file):
        return None  # hub id or missing directory: core reports / notes it
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    return config.get("text_config", config)


def check_role(
    role_name: str, config: MegatronParallelConfig, shape: dict | None, report: ErrorReport
) -> None:
    where = join_path(role_name, "strategy_args", "strategy_config")
    tp = config.tensor_model_parallel_size
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    ep = config.expert_model_parallel_size

    if config.sequence_parallel and tp == 1:
        # Megatron-LM turns it off the same way; ROLL's recipes set it with TP1 (seed 000).
        report.note(
            f"{where}.sequence_parallel",
            "sequence parallelism splits activations over tensor-parallel ranks: off at "
            "tensor_model_parallel_size 1",
        )
    if config.virtual_pipeline_model_parallel_size and pp == 1:
        report.error(
            f"{where}.virtual_pipeline_model_parallel_size",
            "virtual pipeline stages need pipeline_model_parallel_size > 1",
            "remove virtual_pipeline_model_parallel_size or raise pipeline_model_parallel_size",
        )
    if config.context_parallel_size > 1 and config.attention_backend == "local":
        report.error(
            f"{where}.context_parallel_size",
            "megatron-core's local (unfused) attention has no context parallelism",
            "use attention_backend: auto (SDPA or TransformerEngine) or context_parallel_size: 1",
        )
    for key in ("grad_offload", "optimizer_offload"):
        if isinstance(config, MegatronInferConfig) and getattr(config, key):
            report.error(
                f"{where}.{key}",
                "megatron_infer keeps no gradients or optimizer state to offload",
                f"set {key}: false (param_offload moves the weights)",
            )
    if config.pack_sequences:
        _check_packing(report, where, config)
    if config.use_dist_checkpointing and not config.dist_checkpointing_path:
        report.error(
            f"{where}.dist_checkpointing_path",
            "use_dist_checkpointing loads the initial weights from a Megatron dist checkpoint: "
            "give its directory",
            "set dist_checkpointing_path (make one with `posttrain convert`)",
        )
    _check_overrides(where, config.override_transformer_config, report)
    if shape is None:
        return
    if not config.use_mbridge and not config.use_dist_checkpointing:
        # HF weights through the plugin's own converter, which covers dense models only. (For a
        # hub id the shape is unknown here; loading reports the same.)
        reason = unsupported_reason(shape)
        if reason is not None:
            report.error(
                f"{where}.use_mbridge",
                f"use_mbridge and use_dist_checkpointing are both off, and {reason}",
                "set use_mbridge: true, or convert the model with `posttrain convert "
                "hf-to-megatron HF_DIR OUT_DIR` and set use_dist_checkpointing: true, "
                "dist_checkpointing_path: OUT_DIR",
            )
    heads = shape.get("num_attention_heads")
    kv_heads = shape.get("num_key_value_heads") or heads
    layers = shape.get("num_hidden_layers")
    experts = (
        shape.get("num_experts") or shape.get("num_local_experts") or shape.get("n_routed_experts")
    )
    if heads and heads % tp:
        report.error(
            f"{where}.tensor_model_parallel_size",
            f"the model's {heads} attention heads do not divide over {tp} tensor-parallel ranks",
            f"use a divisor of {heads}",
        )
    elif kv_heads and kv_heads % tp and tp % kv_heads:
        report.error(
            f"{where}.tensor_model_parallel_size",
            f"the model's {kv_heads} key/value heads do not split over (or replicate across) "
            f"{tp} tensor-parallel ranks",
            f"use a divisor or a multiple of {kv_heads}",
        )
    if layers and layers % (pp * vpp):
        report.error(
            f"{where}.pipeline_model_parallel_size",
            f"the model's {layers} layers do not divide into {pp} pipeline stage(s) x {vpp} "
            f"virtual stage(s) = {pp * vpp} chunks",
            f"make pipeline x virtual pipeline sizes a divisor of {layers}",
        )
    if ep > 1 and not experts:
        report.error(
            f"{where}.expert_model_parallel_size",
            "the model has no experts (not a MoE model): expert parallelism does not apply",
            "set expert_model_parallel_size: 1",
        )
    if experts and pp > 1 and config.moe_token_dispatcher_type == "allgather":
        report.error(
            f"{where}.moe_token_dispatcher_type",
            "the allgather dispatcher cannot take micro-batches of varying length, which "
            "pipeline parallelism sends between stages",
            "use moe_token_dispatcher_type: alltoall (GPU) or pipeline_model_parallel_size: 1",
        )
    if experts and experts % ep:
        report.error(
            f"{where}.expert_model_parallel_size",
            f"the model's {experts} experts do not divide over {ep} expert-parallel ranks",
            f"use a divisor of {experts}",
        )


def _check_overrides(where: str, overrides: dict[str, Any], report: ErrorReport) -> None:
    if not overrides:
        return
    fields = transformer_config_fields()
    for key in overrides:
        path = f"{where}.override_transformer_config.{key}"
        if key in _LAYOUT_KEYS:
            report.error(
                path,
                f"{key} is a layout key of the strategy: set it in strategy_config directly",
                f"move it to strategy_config.{key}",
            )
        elif fields is not None and key not in fields:
            report.error(
                path,
                "not a field of megatron-core's TransformerConfig",
                did_you_mean(key, fields),
            )


def _check_packing(report: ErrorReport, where: str, config: MegatronParallelConfig) -> None:
    if config.attention_backend in ("local", "transformer_engine"):
        report.error(
            f"{where}.pack_sequences",
            f"packed sequences run on the SDPA attention spec, not {config.attention_backend!r}",
            "set attention_backend: sdpa, or pack_sequences: false",
        )
    if config.context_parallel_size > 1:
        report.error(
            f"{where}.pack_sequences",
            "packed sequences are not split over context-parallel ranks",
            "set pack_sequences: false, or context_parallel_size: 1",
        )
    if config.expert_model_parallel_size > 1 and config.moe_token_dispatcher_type == "allgather":
        report.error(
            f"{where}.pack_sequences",
            "the allgather MoE dispatcher needs equal token counts on every expert-parallel "
            "rank, which packed micro-batches do not have",
            "set moe_token_dispatcher_type: alltoall, or pack_sequences: false",
        )
