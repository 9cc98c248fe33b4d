"""The ``fsdp2_train`` and ``fsdp2_infer`` strategies: HF models sharded with PyTorch FSDP2.

This module is cheap to import (no torch): ``posttrain validate`` and ``posttrain plugins`` load
it. The hooks import :mod:`posttrain_fsdp.engine` when a rank of one of these strategies first
needs it.
"""

from __future__ import annotations

from typing import Literal

import attrs

from posttrain import hookimpl
from posttrain.strategy import Capabilities, StrategySpec

TRAIN = "fsdp2_train"
INFER = "fsdp2_infer"
STRATEGIES = (TRAIN, INFER)

DtypeName = Literal["fp32", "bf16", "fp16"]


def _positive_or_none(instance, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1 (or null), got {value}")


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
    # Rows per micro-batch; None: training_args.per_device_train_batch_size.
    micro_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    # Rows per forward pass when computing log-probs; None: micro_batch_size.
    logprob_micro_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)


@attrs.frozen(kw_only=True)
class FSDP2InferConfig:
    """``strategy_config`` of ``fsdp2_infer`` (reference / old-policy log-probs)."""

    # Rows per forward pass; None: the role's infer_batch_size, else 8.
    micro_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    # Compute dtype of the all-gathered parameters; None: the role's model_args.dtype.
    param_dtype: DtypeName | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False


@hookimpl
def posttrain_add_strategies():
    return [
        StrategySpec(
            name=TRAIN,
            config_class=FSDP2TrainConfig,
            capabilities=Capabilities(
                kind="train", exports_hf_weights=True, computes_logprobs=True
            ),
            description="training with PyTorch FSDP2 and torch DCP checkpoints",
        ),
        StrategySpec(
            name=INFER,
            config_class=FSDP2InferConfig,
            capabilities=Capabilities(kind="infer", computes_logprobs=True),
            description="log-probs (reference / old policy) with a PyTorch FSDP2-sharded model",
        ),
    ]


def _engine(worker):
    if worker.strategy_name not in STRATEGIES:
        return None
    from posttrain_fsdp import engine

    return engine


@hookimpl
def posttrain_setup_parallel(worker):
    engine = _engine(worker)
    return engine.setup_parallel(worker) if engine else None


@hookimpl
def posttrain_load_model(worker):
    engine = _engine(worker)
    return engine.load_model(worker) if engine else None


@hookimpl
def posttrain_compute_logprobs(worker, batch):
    engine = _engine(worker)
    return engine.compute_logprobs(worker, batch) if engine else None


@hookimpl
def posttrain_train_step(worker, batch, loss_fn):
    if worker.strategy_name != TRAIN:
        return None
    from posttrain_fsdp import engine

    return engine.train_step(worker, batch, loss_fn)


@hookimpl
def posttrain_export_weights(worker, bucket_bytes):
    engine = _engine(worker)
    return engine.export_weights(worker, bucket_bytes) if engine else None


@hookimpl
def posttrain_save_checkpoint(worker, path):
    engine = _engine(worker)
    return engine.save_checkpoint(worker, path) if engine else None


@hookimpl
def posttrain_load_checkpoint(worker, path):
    engine = _engine(worker)
    return engine.load_checkpoint(worker, path) if engine else None


@hookimpl
def posttrain_export_hf(worker, path):
    engine = _engine(worker)
    return engine.export_hf(worker, path) if engine else None


@hookimpl
def posttrain_release_memory(worker, tags):
    engine = _engine(worker)
    return engine.release_memory(worker, tags) if engine else None


@hookimpl
def posttrain_resume_memory(worker, tags):
    engine = _engine(worker)
    return engine.resume_memory(worker, tags) if engine else None


@hookimpl
def posttrain_shutdown_worker(worker):
    engine = _engine(worker)
    return engine.shutdown(worker) if engine else None
