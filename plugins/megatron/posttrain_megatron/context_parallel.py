"""Context parallelism: sequences split over the CP ranks, as megatron-core lays them out.

With causal attention the end of a sequence costs more than its start, so megatron splits each
sequence into ``2 * cp`` chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``
(``megatron.core.utils.get_batch_on_this_cp_rank``); its rotary embedding picks the same
positions. :func:`split_for_rank` makes that layout, :func:`gather_sequence` undoes it over the
CP group (differentiable: the gradient of the whole sequence is summed over the ranks and each
keeps its chunks).

Attention (``layer_spec.SDPACoreAttention``) gathers the keys and values of the whole sequence
(small next to the queries with grouped-query attention) and runs each local query chunk
against the keys up to its end, with a causal mask aligned to the bottom right.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 * cp_size``) that ``cp_rank`` holds, in its order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_rank(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's chunks of ``tensor`` along ``dim`` (its length a multiple of 2 * cp_size)."""
    if tensor.shape[dim] % (2 * cp_size):
        raise ValueError(
            f"context parallelism: length {tensor.shape[dim]} is not a multiple of 2 x {cp_size}"
        )
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_size, cp_rank)], dim=dim)


def natural_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's local part (``parts[r]`` from rank r)."""
    cp_size = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(cp_size, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def gather_sequence(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence on every CP rank, from each rank's :func:`split_for_rank` part."""
    return _GatherSequence.apply(local, dim, group)


class _GatherSequence(torch.autograd.Function):
    # ctx: Any, as torch's context carries the attributes forward sets for backward.
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return natural_order(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Every rank's use of the whole sequence adds to each chunk's gradient. An all-reduce
        # rather than a reduce-scatter: gloo has none (and the gathered tensors are small).
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return split_for_rank(grad, ctx.dim, size, rank), None, None
