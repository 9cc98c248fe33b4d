"""Packed micro-batches (``pack_sequences``): the real tokens of every row in one sequence.

Right-padded rows cost the matmuls of their padding; RL batches mix short and long responses,
so that can be most of a micro-batch. Packed, a micro-batch is one row of ``sum(lengths)`` tokens
(megatron's THD format: ``PackedSeqParams`` with the sequences' boundaries), rotary positions
restart at each sequence (megatron applies them per sequence) and attention runs per sequence
(``layer_spec.SDPACoreAttention``). Results come back in the rows' padded layout.
"""

from __future__ import annotations

import attrs
import torch

from posttrain_megatron import token_scores


@attrs.frozen
class Packed:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]: next token inside each sequence, NO_TARGET at its end
    params: object  # megatron PackedSeqParams
    index: torch.Tensor  # [rows, width]: each padded position's place in the packed row
    real: torch.Tensor  # [rows, width]: True where the padded position holds a real token


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int) -> Packed:
    """``input_ids`` / ``attention_mask``: [rows, width], right-padded. The packed row is padded
    to a multiple of ``multiple`` (sequence parallelism) with a filler sequence of its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = input_ids.device
    lengths = attention_mask.sum(dim=1).to(torch.int64).cpu()
    if bool((lengths == 0).any()):
        raise ValueError("megatron: a row without tokens cannot be packed")
    total = int(lengths.sum())
    filler = -total % multiple
    bounds = torch.cat([lengths, torch.tensor([filler] if filler else [], dtype=torch.int64)])
    # Boundaries on the host: the per-sequence loops (rotary, attention) read them there.
    cu = torch.nn.functional.pad(bounds.cumsum(0), (1, 0)).to(torch.int32)

    width = input_ids.shape[1]
    positions = torch.arange(width).unsqueeze(0)
    real = (positions < lengths.unsqueeze(1)).to(device)
    index = (cu[:-1, None][: len(lengths)].to(torch.int64) + positions).to(device)
    index = torch.where(real, index, 0)

    ids = torch.zeros(total + filler, dtype=input_ids.dtype, device=device)
    ids[index[real]] = input_ids[real]
    next_ids = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    has_next = torch.nn.functional.pad(real[:, 1:], (0, 1), value=False)
    labels = torch.full_like(ids, token_scores.NO_TARGET)
    labels[index[has_next]] = next_ids[has_next]
    pos = torch.zeros_like(ids)
    pos[index[real]] = positions.to(device).expand_as(real)[real]
    longest = int(bounds.max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return Packed(ids[None], pos[None], labels[None], params, index, real)


def unpack(packed: Packed, values: torch.Tensor) -> torch.Tensor:
    """Per-token ``values`` [1, T, ...] of the packed row as [rows, width, ...] in the rows'
    padded layout (zeros at padding); differentiable."""
    out = values[0][packed.index]
    mask = packed.real.reshape(*packed.real.shape, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
