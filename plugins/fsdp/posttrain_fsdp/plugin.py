"""The ``fsdp2_train`` and ``fsdp2_infer`` strategies: HF models sharded with PyTorch FSDP2.

This module is cheap to import (no torch): ``posttrain validate`` and ``posttrain plugins`` load
it. The worker hooks (from :class:`posttrain.EngineHooks`) import
:mod:`posttrain_fsdp.engine` when a rank of one of these strategies first needs it.
"""

from __future__ import annotations

from typing import Literal

import attrs

from posttrain import Capabilities, EngineHooks, StrategySpec, at_least, hookimpl

TRAIN = "fsdp2_train"
INFER = "fsdp2_infer"
STRATEGIES = (TRAIN, INFER)

DtypeName = Literal["fp32", "bf16", "fp16"]


@attrs.frozen(kw_only=True)
class FSDP2TrainConfig:
    """``strategy_config`` of ``fsdp2_train``.

    Master weights and optimizer state are float32; ``param_dtype`` is the dtype of the gathered
    weights the forward/backward run in (mixed precision). Gradient checkpointing follows
    ``model_args.disable_gradient_checkpointing``; micro-batching follows ``training_args``
    (``use_dynamic_batch_size`` / ``max_tokens_per_micro_batch``) unless set here.
    """

    # Compute dtype of the all-gathered parameters; None: the role's model_args.dtype.
    param_dtype: DtypeName | None = None
    # Dtype of the gradient reduce-scatter; None: same as param_dtype.
    reduce_dtype: DtypeName | None = None
    # Free the gathered parameters after forward (ZeRO-3); False keeps them for backward (ZeRO-2).
    reshard_after_forward: bool = True
    # Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy).
    cpu_offload: bool = False
    # Move the weights and gradients (param_offload) and the optimizer state (optimizer_offload)
    # to host memory while another role on the same GPUs runs, as verl's knobs; off, they stay
    # on the device: faster, when memory allows.
    param_offload: bool = False
    optimizer_offload: bool = False
    # Rows per micro-batch; None: training_args.per_device_train_batch_size.
    micro_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # Rows per forward pass when computing log-probs; None: micro_batch_size.
    logprob_micro_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # Log-probs from the output head this many tokens at a time (forward and backward), never
    # the whole [tokens, vocab] float32 logits; 0: from the full logits, as before.
    logprob_chunk_tokens: int = attrs.field(
        default=1024, validator=at_least(1, also={0: "off: full logits"})
    )


@attrs.frozen(kw_only=True)
class FSDP2InferConfig:
    """``strategy_config`` of ``fsdp2_infer`` (reference / old-policy log-probs)."""

    # Rows per forward pass; None: the role's infer_batch_size, else 8.
    micro_batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    # Compute dtype of the all-gathered parameters; None: the role's model_args.dtype.
    param_dtype: DtypeName | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Move the weights to host memory while another role on the same GPUs runs.
    param_offload: bool = False
    # Log-probs from the output head this many tokens at a time (forward and backward), never
    # the whole [tokens, vocab] float32 logits; 0: from the full logits, as before.
    logprob_chunk_tokens: int = attrs.field(
        default=1024, validator=at_least(1, also={0: "off: full logits"})
    )


class FSDPPlugin(EngineHooks):
    strategies = STRATEGIES
    engine = "posttrain_fsdp.engine"

    @hookimpl
    def posttrain_add_strategies(self):
        return [
            StrategySpec(
                name=TRAIN,
                config_class=FSDP2TrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    exports_hf_weights=True,
                    computes_logprobs=True,
                    shares_process=True,
                    heads=("lm", "value"),
                    lora=True,
                ),
                description="training (actor or critic) with PyTorch FSDP2 and DCP checkpoints",
            ),
            StrategySpec(
                name=INFER,
                config_class=FSDP2InferConfig,
                capabilities=Capabilities(
                    kind="infer",
                    computes_logprobs=True,
                    shares_process=True,
                    heads=("lm", "score"),
                ),
                description="log-probs (reference) or reward-model scores, FSDP2-sharded",
            ),
        ]


plugin = FSDPPlugin()
