"""Typed ``strategy_config`` of ``deepspeed_train`` and ``deepspeed_infer`` (no torch import).

The fields are the ZeRO knobs users set most (OpenRLHF's and DeepSpeed's own names); anything
else goes through ``ds_config``, a DeepSpeed config dict merged over what the plugin builds. Its
keys are checked against the installed DeepSpeed's config schema at validation time (read from
its sources, see :mod:`posttrain_deepspeed.ds_schema`) and by DeepSpeed itself at start.
"""

from __future__ import annotations

from typing import Any

import attrs

from posttrain import ScoringOptions, at_least, between
from posttrain.backend import ReleaseKnob


@attrs.frozen(kw_only=True)
class DeepSpeedZeroConfig(ScoringOptions):
    """ZeRO knobs shared by both strategies (with the rows per forward pass and log-prob
    chunking of :class:`posttrain.ScoringOptions`)."""

    # 1: optimizer state partitioned; 2: + gradients; 3: + parameters.
    zero_stage: int = attrs.field(default=2, validator=between(1, 3))
    # ZeRO-Offload of the parameters (ZeRO-3 only) to host memory; "nvme" is not offered.
    offload_param: bool = False
    # Build the model partitioned (deepspeed.zero.Init) at ZeRO-3, so no rank ever holds all of
    # it; false: every rank loads the whole model on the host first.
    zero_init: bool = True
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    # Elements per gradient reduce bucket (ZeRO-1/2) / per reduce at ZeRO-3.
    reduce_bucket_size: int = attrs.field(default=500_000_000, validator=at_least(1))
    allgather_bucket_size: int = attrs.field(default=500_000_000, validator=at_least(1))
    # ZeRO-3: parameters smaller than this (elements) stay gathered, and how many gathered
    # parameters may stay live; prefetch depth.
    stage3_param_persistence_threshold: int = attrs.field(default=100_000, validator=at_least(0))
    stage3_max_live_parameters: int = attrs.field(default=1_000_000_000, validator=at_least(0))
    stage3_max_reuse_distance: int = attrs.field(default=1_000_000_000, validator=at_least(0))
    stage3_prefetch_bucket_size: int = attrs.field(default=50_000_000, validator=at_least(0))
    # Move the engine's states (weights, gradients, optimizer state) to host memory while
    # another role on the same GPUs runs (DeepSpeed's offload_states); off, they stay on the
    # device: faster, when memory allows; auto: on where the memory plan needs it.
    release_when_idle: ReleaseKnob = "auto"
    # Any other DeepSpeed config keys, merged over what the plugin builds (nested dicts merge).
    ds_config: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class DeepSpeedTrainConfig(DeepSpeedZeroConfig):
    """``strategy_config`` of ``deepspeed_train``.

    The optimizer is AdamW with ``training_args``' hyper-parameters: torch's own AdamW (nothing
    to compile), or DeepSpeed's CPU Adam with ``offload_optimizer`` (a C++ op DeepSpeed builds on
    first use). Master weights are float32; ``model_args.dtype`` bf16 / fp16 turns on DeepSpeed's
    bf16 / fp16 (loss-scaled) mixed precision. Clipping uses ``training_args.max_grad_norm``;
    micro-batching follows ``training_args`` unless set here; gradient checkpointing follows
    ``model_args.disable_gradient_checkpointing``.
    """

    # ZeRO-Offload of the optimizer state and step to host memory (DeepSpeedCPUAdam).
    offload_optimizer: bool = False


@attrs.frozen(kw_only=True)
class DeepSpeedInferConfig(DeepSpeedZeroConfig):
    """``strategy_config`` of ``deepspeed_infer`` (reference / old-policy log-probs).

    No optimizer: ZeRO-3 partitions the parameters over the ranks; stages 1 and 2 (which
    partition optimizer state and gradients only) keep a full copy per rank. Rows per forward
    pass: ``logprob_micro_batch_size`` or ``micro_batch_size``, else the role's
    ``infer_batch_size``, else 8.
    """

    zero_stage: int = attrs.field(default=3, validator=between(1, 3))
