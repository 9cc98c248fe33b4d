"""HF-named weights out of a megatron model: weight-sync buckets and HF directories.

mbridge's ``export_weights`` walks the parameters in a fixed global order, gathering each one
across TP / PP / EP as it goes, so at most one full tensor (plus the bucket being filled on rank
0) is alive at a time: no rank ever holds the whole model. Every rank of the role must iterate
it in step (the gathers are collectives); only global rank 0 keeps tensors (every rank, for a
rollout role in the same process).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from posttrain import WeightBucket, bucketize
from posttrain.backend import export_streamed, is_rank0, save_tokenizer_beside, torch_dtype
from posttrain_megatron.state import MegatronState

if TYPE_CHECKING:
    from posttrain import WorkerContext

log = logging.getLogger(__name__)


def hf_tensors(
    worker: WorkerContext, keep: bool, device: str | None = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` in the export dtype on ``device`` (None: where mbridge's gather
    left it, on this rank's GPU, with no copy when the dtype matches); meta tensors when
    ``keep`` is False."""
    dtype = torch_dtype(worker.model_args.dtype)
    seen: set[str] = set()
    for name, tensor in worker.engine_state(MegatronState).bridge.export_weights(worker.model):
        if name in seen:  # a tied output layer on the last PP stage maps to the embedding
            continue
        seen.add(name)
        if keep and device is None:
            yield name, tensor.detach().to(dtype=dtype)
        elif keep:
            yield name, tensor.detach().to(device=device, dtype=dtype, copy=True)
        else:
            yield name, torch.empty(tensor.shape, dtype=dtype, device="meta")


def export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool = False
) -> Iterator[WeightBucket]:
    return _buckets(worker, bucket_bytes, on_device)


def _buckets(worker: WorkerContext, bucket_bytes: int, on_device: bool) -> Iterator[WeightBucket]:
    # mbridge's walk gives every rank each full tensor: in process, every rank keeps them.
    keep = on_device or is_rank0()
    device = None if on_device else "cpu"
    for bucket in bucketize(hf_tensors(worker, keep=keep, device=device), bucket_bytes):
        yield bucket if keep else WeightBucket()


def export_hf(worker: WorkerContext, path: str) -> bool:
    """Streamed: mbridge's walk gathers one tensor at a time on every rank and rank 0 writes each
    safetensors shard as soon as it is full, holding at most one shard on the host."""
    export_streamed(
        hf_tensors(worker, keep=is_rank0()), path, lambda out: write_hf_config(worker, out)
    )
    return True


def write_hf_config(worker: WorkerContext, path: str) -> None:
    """The config (and tokenizer) beside exported weights."""
    hf_config = worker.engine_state(MegatronState).bridge.hf_config
    if worker.head == "value":  # a critic's directory loads as the value model it is
        from posttrain_megatron.value_head import export_config

        hf_config = export_config(hf_config)
    hf_config.dtype = torch_dtype(worker.model_args.dtype)
    hf_config.save_pretrained(path)
    save_tokenizer_beside(worker, path, log)
