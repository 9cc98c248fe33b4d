"""The memory estimates of ``deepspeed_train`` and ``deepspeed_infer`` (no torch, no deepspeed):
what ZeRO keeps on each GPU at each stage, for ``posttrain plan``."""

from __future__ import annotations

from posttrain import (
    MemoryQuery,
    RoleMemory,
    dtype_bytes,
    forward_working_bytes,
    logit_bytes,
    training_activation_bytes,
)

# AdamW's two float32 moments and the float32 master copy: 12 bytes a parameter.
MASTER_AND_ADAM = 12


def estimate_train(query: MemoryQuery) -> RoleMemory:
    """Compute-dtype weights (partitioned at ZeRO-3), gradients (partitioned from ZeRO-2) and
    the float32 master weights with AdamW's state (partitioned always; on the host with
    ``offload_optimizer``), plus a micro-batch's activations and logits."""
    g, cfg, ranks = query.geometry, query.config, query.gpus
    compute = query.dtype_bytes
    mixed = compute < 4  # bf16 / fp16: a float32 master copy besides the compute weights
    weights = g.params * compute // (ranks if cfg.zero_stage == 3 else 1)
    grads = g.params * 4 // (ranks if cfg.zero_stage >= 2 else 1)
    master = (MASTER_AND_ADAM if mixed else 8) * g.params // ranks
    resident = {
        "weights": 0 if cfg.offload_param else weights,
        "grads": grads,
        "optimizer": 0 if cfg.offload_optimizer else master,
    }
    train_tokens = query.train_micro_batch_tokens(cfg.micro_batch_size)
    score_tokens = query.train_micro_batch_tokens(
        cfg.logprob_micro_batch_size or cfg.micro_batch_size
    )
    gathered = _gathered(query) if cfg.zero_stage == 3 else 0
    chunk = cfg.logprob_chunk_tokens
    phases = {
        "train": {
            "activations": training_activation_bytes(g, train_tokens, compute, query.recompute),
            "logits": logit_bytes(g, train_tokens, chunk, compute, training=True),
            "gathered": gathered,
        },
        "logprobs": {
            "forward": forward_working_bytes(g, score_tokens, compute),
            "logits": logit_bytes(g, score_tokens, chunk, compute, training=False),
            "gathered": gathered,
        },
    }
    path = f"{query.role_name}.strategy_args.strategy_config"
    return RoleMemory(
        resident=resident,
        phases=phases,
        released=frozenset(resident) if cfg.release_when_idle else frozenset(),
        knobs=(
            f"{query.role_name}.model_args.disable_gradient_checkpointing: false (recompute "
            "activations)",
            f"{query.role_name}.training_args.max_tokens_per_micro_batch (with "
            "use_dynamic_batch_size: true) or per_device_train_batch_size: fewer tokens a pass",
            f"{path}.zero_stage: 3 (weights partitioned too)",
            f"{path}.offload_optimizer: true (AdamW's state in host memory)",
            f"{path}.release_when_idle: true (host memory while others run)",
        ),
    )


def estimate_infer(query: MemoryQuery) -> RoleMemory:
    """The weights (partitioned at ZeRO-3) and one micro-batch's forward pass."""
    g, cfg = query.geometry, query.config
    compute = query.dtype_bytes
    tokens = query.scoring_micro_batch_tokens(cfg.micro_batch_size)
    weights = g.params * compute // (query.gpus if cfg.zero_stage == 3 else 1)
    phases = {
        "logprobs": {
            "forward": forward_working_bytes(g, tokens, compute),
            "logits": logit_bytes(g, tokens, cfg.logprob_chunk_tokens, compute, training=False),
            "gathered": _gathered(query) if cfg.zero_stage == 3 else 0,
        }
    }
    path = f"{query.role_name}.strategy_args.strategy_config"
    return RoleMemory(
        resident={"weights": 0 if cfg.offload_param else weights},
        phases=phases,
        released=frozenset({"weights"}) if cfg.release_when_idle else frozenset(),
        knobs=(
            f"{path}.micro_batch_size or {query.role_name}.infer_batch_size: fewer rows a pass",
            f"{path}.release_when_idle: true (host memory while others run)",
        ),
    )


def _gathered(query: MemoryQuery) -> int:
    """ZeRO-3's gathered parameters: up to ``stage3_max_live_parameters`` elements, at most
    the whole model; in practice a layer or two with prefetch (its bucket)."""
    g, cfg = query.geometry, query.config
    live = min(g.params, 2 * g.layer_params + cfg.stage3_prefetch_bucket_size)
    return live * dtype_bytes(query.role.model_args.dtype)
