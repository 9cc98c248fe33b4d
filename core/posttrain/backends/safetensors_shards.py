"""Writing an HF model's weights as safetensors shards while they are produced.

Exports gather one full tensor at a time; :func:`write_shards` writes each shard as soon as it is
full (``model-00001-of-0000N.safetensors`` and the index, or one ``model.safetensors``), so the
writer holds at most one shard of the model in host memory, not the whole model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from posttrain.backends.plumbing import is_rank0
from posttrain.backends.tensors import unshare_storage

if TYPE_CHECKING:
    import torch

MAX_SHARD_BYTES = 5 * 2**30  # as transformers' save_pretrained


def write_shards(
    named: Iterable[tuple[str, torch.Tensor]], path: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> int:
    """Write ``(hf_name, tensor)`` pairs into ``path``; returns the bytes written."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    parts: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        part = f".shard-{len(parts) + 1:05d}.safetensors"
        save_file(unshare_storage(shard.items()), os.path.join(path, part), {"format": "pt"})
        parts.append((part, list(shard)))
        shard.clear()

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    if shard or not parts:
        flush()
    # Final names need the shard count, known only now.
    if len(parts) == 1:
        os.replace(os.path.join(path, parts[0][0]), os.path.join(path, "model.safetensors"))
        return total
    weight_map = {}
    for i, (part, names) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(os.path.join(path, part), os.path.join(path, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def export_streamed(
    named: Iterable[tuple[str, torch.Tensor]], path: str, write_config: Callable[[str], None]
) -> None:
    """``posttrain_export_hf`` of a sharded trainer: every rank walks ``named`` (its gathers are
    collective), rank 0 writes each shard as soon as it is full and then the config
    (``write_config(path)``); the others drop what they gathered. Ends with a barrier."""
    import torch.distributed as dist

    if is_rank0():
        write_shards(named, path)
        write_config(path)
    else:
        for _ in named:  # take part in every gather; rank 0 keeps the tensors
            pass
    if dist.is_initialized():
        dist.barrier()
