"""The memory estimates of ``megatron_train`` and ``megatron_infer`` (no torch, no megatron):
one GPU's shard of the model under tensor and pipeline parallelism, the DDP gradient buffer, the
(distributed) optimizer, and a micro-batch's activations, for ``posttrain plan``."""

from __future__ import annotations

import attrs

from posttrain.backend import (
    MemoryQuery,
    ModelGeometry,
    RoleMemory,
    forward_working_bytes,
    logit_bytes,
    release_knobs,
    training_activation_bytes,
)
from posttrain_megatron.checks import lora_targets

# AdamW's two float32 moments and the float32 master copy: 12 bytes a parameter.
MASTER_AND_ADAM = 12
# A float32 model has no master copy: megatron's FP32Optimizer (and the distributed optimizer's
# float32 shards, views of the parameters) step the parameters themselves (measured:
# tests/megatron/test_megatron_memory_plan.py).
ADAM = 8


def shard_params(g: ModelGeometry, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on the busiest GPU: its pipeline stage's layers and, on the first and last
    stages, the embedding and the output layer, every matrix split over the TP ranks, and a
    MoE model's routed experts over the expert-parallel ranks too."""
    embedding = g.vocab_size * g.hidden_size
    experts = g.expert_params // g.num_hidden_layers  # a layer's share, on average
    layer = g.layer_params - experts + experts // ep
    layers = -(-g.num_hidden_layers // pp) * layer
    # One stage holds both the embedding and the output layer only without pipelining; a tied
    # output layer is the embedding itself.
    heads = 1 if g.tie_word_embeddings or pp > 1 else 2
    return (layers + heads * embedding) // tp


def adapter_params(g: ModelGeometry, rank: int, target_modules: list[str], tp: int, pp: int) -> int:
    """LoRA adapters on the busiest GPU (posttrain_megatron.lora): per adapted linear of its
    stage's layers, ``rank`` x (input + output width), the sharded half split over TP (a
    column-parallel linear's ``B``, a row-parallel one's ``A``), the other whole."""
    h, q, ff = g.hidden_size, g.num_attention_heads * g.head_dim, g.intermediate_size
    # megatron linear: (input width, output width, column-parallel)
    widths = {
        "self_attention.linear_qkv": (h, q + 2 * g.kv_width, True),
        "self_attention.linear_proj": (q, h, False),
        "mlp.linear_fc1": (h, 2 * ff, True),
        "mlp.linear_fc2": (ff, h, False),
    }
    per_layer = 0
    for module in lora_targets(target_modules):
        fan_in, fan_out, column = widths[module]
        per_layer += rank * (fan_in + fan_out // tp if column else fan_in // tp + fan_out)
    return -(-g.num_hidden_layers // pp) * per_layer


def _per_rank_geometry(g: ModelGeometry, tp: int) -> ModelGeometry:
    """The widths one TP rank computes: its share of the MLP, of the key/value heads and of the
    vocabulary (the hidden state stays whole without sequence parallelism)."""
    return attrs.evolve(
        g,
        intermediate_size=max(1, g.intermediate_size // tp),
        # Each expert split like a dense MLP (expert_tensor_parallel_size defaults to tp).
        expert_intermediate_size=g.expert_intermediate_size // tp,
        shared_expert_intermediate_size=g.shared_expert_intermediate_size // tp,
        num_key_value_heads=max(1, g.num_key_value_heads // tp),
        vocab_size=-(-g.vocab_size // tp),
    )


def _layout(query: MemoryQuery) -> tuple[int, int, int]:
    cfg = query.config
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp = max(1, query.gpus // (tp * pp * cfg.context_parallel_size))
    return tp, pp, dp


def _recompute(query: MemoryQuery) -> bool:
    granularity = query.config.recompute_granularity
    if granularity is not None:
        return granularity == "full"
    return query.recompute


def estimate_train(query: MemoryQuery) -> RoleMemory:
    """Weights and the DDP gradient buffer in the compute dtype, the float32 master weights
    (below float32 only) and AdamW's state (split over data-parallel ranks with
    ``use_distributed_optimizer``), and a micro-batch's activations over this rank's widths."""
    g, cfg = query.geometry, query.config
    tp, pp, dp = _layout(query)
    compute = query.dtype_bytes
    params = shard_params(g, tp, pp, cfg.expert_model_parallel_size)
    optimizer_shards = dp if cfg.use_distributed_optimizer else 1
    lora = query.role.model_args.lora if query.role_name == "actor_train" else None
    # With LoRA the base is frozen: gradients and optimizer state are the adapters' alone.
    trained = params
    if lora is not None:
        trained = adapter_params(g, lora.rank, list(lora.target_modules), tp, pp)
    resident = {
        "weights": (params + (trained if lora is not None else 0)) * compute,
        "grads": trained * compute,
        "optimizer": (MASTER_AND_ADAM if compute < 4 else ADAM) * trained // optimizer_shards,
    }
    rank = _per_rank_geometry(g, tp)
    sequence_split = tp if cfg.sequence_parallel else 1
    train_tokens = query.train_micro_batch_tokens(cfg.micro_batch_size, dp)
    score_tokens = query.scoring_micro_batch_tokens(cfg.scoring_rows(), dp)
    chunk = cfg.logprob_chunk_tokens
    recompute = _recompute(query)
    phases = {
        "train": {
            # The float16 optimizer's float32 copy of the gradients, freed after its step (a
            # float32 model steps on the DDP buffer itself: none).
            "main_grads": 4 * trained // optimizer_shards if compute < 4 else 0,
            "activations": training_activation_bytes(
                rank, train_tokens // sequence_split, compute, recompute
            ),
            "logits": logit_bytes(rank, train_tokens, chunk, compute, training=True),
        },
        "logprobs": {
            "forward": forward_working_bytes(rank, score_tokens, compute),
            "logits": logit_bytes(rank, score_tokens, chunk, compute, training=False),
        },
    }
    knob = f"{query.role_name}.model_args.disable_gradient_checkpointing: false"
    released, auto = release_knobs(
        cfg,
        {
            "param_offload": ("weights",),
            "grad_offload": ("grads",),
            "optimizer_offload": ("optimizer",),
        },
    )
    path = f"{query.role_name}.strategy_args.strategy_config"
    return RoleMemory(
        resident=resident,
        phases=phases,
        released=released,
        auto_release=auto,
        knobs=(
            *(() if recompute else (f"{knob} (or {path}.recompute_granularity: full)",)),
            f"{query.role_name}.training_args.max_tokens_per_micro_batch (with "
            "use_dynamic_batch_size: true) or per_device_train_batch_size: fewer tokens a pass",
            *(
                ()
                if cfg.use_distributed_optimizer or lora is not None
                else (
                    f"{path}.use_distributed_optimizer: true (optimizer state split over DP ranks)",
                )
            ),
            f"{path}.tensor_model_parallel_size / pipeline_model_parallel_size: split the model",
            f"{path}.optimizer_offload / grad_offload / param_offload: true (host memory while "
            "others run)",
        ),
    )


def estimate_infer(query: MemoryQuery) -> RoleMemory:
    """This rank's shard of the weights and one micro-batch's forward pass."""
    g, cfg = query.geometry, query.config
    tp, pp, dp = _layout(query)
    compute = query.dtype_bytes
    rank = _per_rank_geometry(g, tp)
    tokens = query.scoring_micro_batch_tokens(cfg.scoring_rows(), dp)
    released, auto = release_knobs(cfg, {"param_offload": ("weights",)})
    path = f"{query.role_name}.strategy_args.strategy_config"
    return RoleMemory(
        resident={"weights": shard_params(g, tp, pp, cfg.expert_model_parallel_size) * compute},
        phases={
            "logprobs": {
                "forward": forward_working_bytes(rank, tokens, compute),
                "logits": logit_bytes(rank, tokens, cfg.logprob_chunk_tokens, compute, False),
            }
        },
        released=released,
        auto_release=auto,
        knobs=(
            f"{path}.logprob_micro_batch_size or {query.role_name}.infer_batch_size: fewer rows "
            "a pass",
            f"{path}.param_offload: true (host memory while others run)",
        ),
    )
