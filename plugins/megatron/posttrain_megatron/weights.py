"""HF-named weights out of a megatron model: weight-sync buckets and HF directories.

mbridge's ``export_weights`` walks the parameters in a fixed global order, gathering each one
across TP / PP / EP as it goes, so at most one full tensor (plus the bucket being filled on rank
0) is alive at a time: no rank ever holds the whole model. Every rank of the role must iterate
it in step (the gathers are collectives); only global rank 0 keeps tensors (every rank, for a
rollout role in the same process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from posttrain import WeightBucket, bucketize
from posttrain.backend import (
    adapter_sync,
    adapter_wire_name,
    export_streamed,
    is_rank0,
    lora_args,
    lora_scaling,
    rank_device,
    save_tokenizer_beside,
    torch_dtype,
    write_lora_adapter,
)
from posttrain_megatron import lora
from posttrain_megatron.model_builder import TRAIN
from posttrain_megatron.state import MegatronState

if TYPE_CHECKING:
    from posttrain import WorkerContext

log = logging.getLogger(__name__)


def hf_tensors(
    worker: WorkerContext, keep: bool, device: str | None = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` in the export dtype on ``device`` (None: where mbridge's gather
    left it, on this rank's GPU, with no copy when the dtype matches); meta tensors when
    ``keep`` is False. A LoRA policy's adapted projections come merged (``W + scale * B @ A``,
    computed on the exported copies: the model is untouched)."""
    args = lora_args(worker, TRAIN)
    if args is None:
        yield from _walk(worker, keep, device, {}, 1.0)
        return
    adapters = lora.hf_adapters(worker)  # collective: every rank, before the walk
    with lora.detached(worker.model):  # the bridge walks the base parameters alone
        yield from _walk(worker, keep, device, adapters, lora_scaling(args))


def _walk(
    worker: WorkerContext,
    keep: bool,
    device: str | None,
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> Iterator[tuple[str, torch.Tensor]]:
    dtype = torch_dtype(worker.model_args.dtype)
    seen: set[str] = set()
    for name, tensor in worker.engine_state(MegatronState).bridge.export_weights(worker.model):
        if name in seen:  # a tied output layer on the last PP stage maps to the embedding
            continue
        seen.add(name)
        if keep and adapters:
            tensor = lora.merged(name, tensor, adapters, scaling)
        if keep and device is None:
            yield name, tensor.detach().to(dtype=dtype)
        elif keep:
            yield name, tensor.detach().to(device=device, dtype=dtype, copy=True)
        else:
            yield name, torch.empty(tensor.shape, dtype=dtype, device="meta")


def synced_adapters(
    worker: WorkerContext, keep: bool, device: str | None = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapter-only sync (``model_args.lora.sync: adapter``): every HF projection's
    ``lora_A`` / ``lora_B`` (:func:`posttrain_megatron.lora.hf_adapters`) in the export dtype
    under its wire name; the base weights are the engine's own already."""
    dtype = torch_dtype(worker.model_args.dtype)
    for module, (a, b) in lora.hf_adapters(worker).items():
        for part, tensor in (("A", a), ("B", b)):
            name = adapter_wire_name(f"{module}.lora_{part}.weight")
            if keep:
                yield name, tensor.to(device=device or rank_device(worker), dtype=dtype)
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
    source = synced_adapters if adapter_sync(worker, TRAIN) else hf_tensors
    for bucket in bucketize(source(worker, keep=keep, device=device), bucket_bytes):
        yield bucket if keep else WeightBucket()


def export_hf(worker: WorkerContext, path: str, merge: bool = False) -> bool:
    """Streamed: mbridge's walk gathers one tensor at a time on every rank and rank 0 writes each
    safetensors shard as soon as it is full, holding at most one shard on the host.

    With LoRA, ``path`` gets the adapter in peft's format; with ``merge``, ``path`` gets the
    merged model and ``path/adapter`` the adapter."""
    if lora_args(worker, TRAIN) is not None:
        _export_adapter(worker, os.path.join(path, "adapter") if merge else path)
        if not merge:
            return True
    export_streamed(
        hf_tensors(worker, keep=is_rank0()), path, lambda out: write_hf_config(worker, out)
    )
    return True


def _export_adapter(worker: WorkerContext, path: str) -> None:
    tensors = lora.peft_tensors(lora.hf_adapters(worker))  # every rank gathers; rank 0 writes
    if is_rank0():
        write_lora_adapter(worker, tensors, path)
        save_tokenizer_beside(worker, path, log)
    dist.barrier()


def write_hf_config(worker: WorkerContext, path: str) -> None:
    """The config (and tokenizer) beside exported weights."""
    hf_config = worker.engine_state(MegatronState).bridge.hf_config
    if worker.head == "value":  # a critic's directory loads as the value model it is
        from posttrain_megatron.value_head import export_config

        hf_config = export_config(hf_config)
    hf_config.dtype = torch_dtype(worker.model_args.dtype)
    hf_config.save_pretrained(path)
    save_tokenizer_beside(worker, path, log)
