"""Typed ``strategy_config`` of ``megatron_train`` and ``megatron_infer`` (no torch import).

Key names are megatron-core's (and ROLL's), so seed workflows from ROLL, verl and Trinity-RFT
carry over unchanged. ``override_transformer_config`` passes any other
``megatron.core.transformer.TransformerConfig`` field through; its keys are checked against the
installed megatron-core at validation time.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain import ScoringOptions, at_least, between
from posttrain.backend import ReleaseKnob

# "auto": TransformerEngine's spec when it is installed, else "sdpa".
AttentionBackend = Literal["auto", "sdpa", "local", "transformer_engine"]


@attrs.frozen(kw_only=True)
class MegatronParallelConfig(ScoringOptions):
    """Model layout and loading, shared by both strategies, with the rows per forward pass and
    log-prob chunking of :class:`posttrain.ScoringOptions`. With ``logprob_chunk_tokens``, log-probs
    come from the output layer a chunk of tokens at a time, vocab-parallel: the whole
    ``[tokens, vocab / tp]`` logits are never built."""

    tensor_model_parallel_size: int = attrs.field(default=1, validator=at_least(1))
    pipeline_model_parallel_size: int = attrs.field(default=1, validator=at_least(1))
    # Model chunks per pipeline rank (interleaved 1F1B); None: no interleaving.
    virtual_pipeline_model_parallel_size: int | None = attrs.field(
        default=None, validator=at_least(1)
    )
    expert_model_parallel_size: int = attrs.field(default=1, validator=at_least(1))
    # TP size inside expert layers; None: same as tensor_model_parallel_size.
    expert_tensor_parallel_size: int | None = attrs.field(default=None, validator=at_least(1))
    context_parallel_size: int = attrs.field(default=1, validator=at_least(1))
    sequence_parallel: bool = False
    # Pack each micro-batch's sequences into one row without padding (THD; verl's
    # use_remove_padding). SDPA attention only; not with context parallelism.
    pack_sequences: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    moe_grouped_gemm: bool = False
    # Core attention implementation (see posttrain_megatron.layer_spec).
    attention_backend: AttentionBackend = "auto"
    # Load HF weights with mbridge (model_args.model_name_or_path is an HF directory).
    use_mbridge: bool = True
    # Load initial weights from a Megatron dist checkpoint at dist_checkpointing_path instead.
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: str | None = None
    # Any other TransformerConfig field, e.g. {apply_rope_fusion: false}.
    override_transformer_config: dict[str, Any] = attrs.field(factory=dict)
    # Move the weights to host memory while another role on the same GPUs runs (colocated roles,
    # as verl's param_offload); off, they stay on the device: faster, when memory allows; auto:
    # on where the memory plan needs it (`posttrain plan` says which).
    param_offload: ReleaseKnob = "auto"


@attrs.frozen(kw_only=True)
class MegatronTrainConfig(MegatronParallelConfig):
    """``strategy_config`` of ``megatron_train``.

    Micro-batching follows ``training_args`` (``per_device_train_batch_size``,
    ``use_dynamic_batch_size`` / ``max_tokens_per_micro_batch``) unless ``micro_batch_size`` is set.
    Activation recompute follows ``model_args.disable_gradient_checkpointing`` unless the
    ``recompute_*`` fields (or ``moe_layer_recompute``) set it.
    """

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    moe_layer_recompute: bool = False
    # Activation recompute, megatron-core's fields. None (and no moe_layer_recompute): what
    # model_args.disable_gradient_checkpointing says, as for the other trainers; false there
    # means full, uniform, one layer per checkpoint. Set here, these win.
    recompute_granularity: Literal["full", "selective"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = attrs.field(default=None, validator=at_least(1))
    # The gradient buffers to host memory while another role runs (auto: as param_offload).
    grad_offload: ReleaseKnob = "auto"
    # megatron-core's CPU optimizer (its state and step on the host), not a release knob.
    optimizer_offload: bool = False
    # Share of the optimizer state kept on the host when optimizer_offload is on.
    optimizer_offload_fraction: float = attrs.field(default=1.0, validator=between(0, 1))


@attrs.frozen(kw_only=True)
class MegatronInferConfig(MegatronParallelConfig):
    """``strategy_config`` of ``megatron_infer`` (reference / old-policy log-probs); its layout
    may differ from the trainer's. Rows per forward pass: ``logprob_micro_batch_size`` or
    ``micro_batch_size``, else the role's ``infer_batch_size``, else 8."""

    # Accepted so a trainer's block carries over (Trinity-RFT's ref sets both to false); an
    # inference role has no gradients or optimizer state, so true is a validation error.
    grad_offload: bool = False
    optimizer_offload: bool = False
