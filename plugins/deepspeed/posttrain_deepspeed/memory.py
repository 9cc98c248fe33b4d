"""The memory estimates of ``deepspeed_train`` and ``deepspeed_infer`` (no torch, no deepspeed):
what ZeRO keeps on each GPU at each stage, for ``posttrain plan``."""

from __future__ import annotations

from posttrain.backend import (
    MemoryQuery,
    ModelGeometry,
    RoleMemory,
    dtype_bytes,
    forward_working_bytes,
    hf_trainer_phases,
    logit_bytes,
    release_knobs,
)

# AdamW's two float32 moments and the float32 master copy: 12 bytes a parameter. DeepSpeed's
# ZeRO optimizers keep the master partition (``single_partition_of_fp32_groups`` at ZeRO-1/2,
# ``fp32_partitioned_groups_flat`` at ZeRO-3) as a copy of their own even when the model is
# float32 (measured: tests/deepspeed/test_deepspeed_memory_plan.py), so 12 in every dtype.
MASTER_AND_ADAM = 12


def tensor_numels(g: ModelGeometry) -> list[int]:
    """The elements of each of the model's parameter tensors (as transformers names them)."""
    h, q, kv, i = g.hidden_size, g.num_attention_heads * g.head_dim, g.kv_width, g.intermediate_size
    layer = [h * q, h * kv, h * kv, q * h, h, h]
    if g.attention_bias:
        layer += [q, kv, kv]
    if g.qk_norm:
        layer += [g.head_dim, g.head_dim]
    dense = [h * i, h * i, i * h]
    # transformers' MoE block: the router, then every expert's gate/up and down fused into
    # one tensor each; a shared expert's three linears and its one-output gate.
    e, ei, shared = g.num_experts, g.expert_intermediate_size, g.shared_expert_intermediate_size
    moe = [e * h, e * 2 * ei * h, e * h * ei] + ([shared * h] * 3 + [h] if shared else [])
    heads = [g.vocab_size * h] * (1 if g.tie_word_embeddings else 2)
    layers = layer * g.num_hidden_layers
    layers += dense * (g.num_hidden_layers - g.moe_layers) + moe * g.moe_layers
    return layers + heads + [h]


def estimate_train(query: MemoryQuery) -> RoleMemory:
    """Compute-dtype weights (partitioned at ZeRO-3, but for its persistent small parameters),
    gradients (partitioned from ZeRO-2; resident at ZeRO-3 with its reduce bucket, only while
    training below it) and the float32 master weights with AdamW's state (partitioned always;
    on the host with ``offload_optimizer``), plus a micro-batch's activations and logits."""
    g, cfg, ranks = query.geometry, query.config, query.gpus
    compute = query.dtype_bytes
    zero3 = cfg.zero_stage == 3
    # The reduce bucket: with contiguous_gradients DeepSpeed allocates reduce_bucket_size
    # elements whatever the model's size (2 GB in float32 at the default 5e8): at ZeRO-3 once,
    # kept; at ZeRO-1/2 for each backward (two with overlap_comm), in the gradients' dtype.
    bucket = cfg.reduce_bucket_size * compute if cfg.contiguous_gradients else 0
    if zero3:
        # Parameters of at most stage3_param_persistence_threshold elements stay whole on
        # every rank beside their partition (norms, biases; a tiny model's every tensor).
        persistent = sum(n for n in tensor_numels(g) if n <= cfg.stage3_param_persistence_threshold)
        weights = compute * (g.params // ranks + persistent)
        # The partitioned gradients (grad_partitions_flat_buffer, in the compute dtype: its
        # gradient_accumulation_dtype) and the bucket stay allocated between steps.
        grads = compute * g.params // ranks + bucket
        training_grads = 0
    else:
        weights = compute * g.params
        grads = 0
        # ZeRO-1/2 free their gradients in the optimizer's step. While backward runs they are
        # in the compute dtype; ZeRO-2's partition keeps every parameter its boundaries cut
        # whole (grads_in_partition): up to one more tensor. (The step's float32 copy of the
        # partition comes after the activations are freed.)
        cut = max(tensor_numels(g)) if ranks > 1 and cfg.zero_stage == 2 else 0
        partition = g.params // ranks + cut if cfg.zero_stage == 2 else g.params
        training_grads = compute * partition + bucket * (2 if cfg.overlap_comm else 1)
    master = MASTER_AND_ADAM * g.params // ranks
    resident = {
        "weights": 0 if cfg.offload_param else weights,
        "grads": grads,
        "optimizer": 0 if cfg.offload_optimizer else master,
    }
    train_tokens = query.train_micro_batch_tokens(cfg.micro_batch_size)
    score_tokens = query.train_micro_batch_tokens(cfg.scoring_rows())
    gathered = _gathered(query) if cfg.zero_stage == 3 else 0
    phases = hf_trainer_phases(
        query,
        dtype_bytes=compute,
        train_tokens=train_tokens,
        score_tokens=score_tokens,
        chunk_tokens=cfg.logprob_chunk_tokens,
        gathered=gathered,
        grads=training_grads,
    )
    path = f"{query.role_name}.strategy_args.strategy_config"
    recompute = f"{query.role_name}.model_args.disable_gradient_checkpointing: false (recompute"
    released, auto = release_knobs(cfg, {"release_when_idle": resident})
    return RoleMemory(
        resident=resident,
        phases=phases,
        released=released,
        auto_release=auto,
        knobs=(
            *(() if query.recompute else (f"{recompute} activations)",)),
            f"{query.role_name}.training_args.max_tokens_per_micro_batch (with "
            "use_dynamic_batch_size: true) or per_device_train_batch_size: fewer tokens a pass",
            *(() if cfg.zero_stage == 3 else (f"{path}.zero_stage: 3 (weights partitioned too)",)),
            f"{path}.offload_optimizer: true (AdamW's state in host memory)",
            f"{path}.release_when_idle: true (host memory while others run)",
        ),
    )


def estimate_infer(query: MemoryQuery) -> RoleMemory:
    """The weights (partitioned at ZeRO-3) and one micro-batch's forward pass."""
    g, cfg = query.geometry, query.config
    compute = query.dtype_bytes
    tokens = query.scoring_micro_batch_tokens(cfg.scoring_rows())
    weights = g.params * compute // (query.gpus if cfg.zero_stage == 3 else 1)
    phases = {
        "logprobs": {
            "forward": forward_working_bytes(g, tokens, compute),
            "logits": logit_bytes(g, tokens, cfg.logprob_chunk_tokens, compute, training=False),
            "gathered": _gathered(query) if cfg.zero_stage == 3 else 0,
        }
    }
    path = f"{query.role_name}.strategy_args.strategy_config"
    released, auto = release_knobs(cfg, {"release_when_idle": ("weights",)})
    return RoleMemory(
        resident={"weights": 0 if cfg.offload_param else weights},
        phases=phases,
        released=released,
        auto_release=auto,
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
