"""Small tensor helpers shared by backends (torch is imported by the caller's engine module)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def unshare_storage(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors by name, with a copy of every tensor whose storage an earlier one uses.

    safetensors refuses tensors that share memory, as tied embeddings and LM heads do."""
    seen: set[int] = set()
    out = {}
    for name, tensor in named:
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
