"""packing.pack / unpack: a right-padded micro-batch as one THD row and back."""

from __future__ import annotations

import torch

from posttrain_megatron import packing, token_scores


def test_pack_lays_rows_end_to_end_and_unpack_restores_them():
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    mask[2] = 1
    packed = packing.pack(ids, mask, multiple=4)

    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    none = token_scores.NO_TARGET
    # The next token inside each sequence; none at a sequence's end.
    assert packed.labels.tolist() == [[6, 7, none, none, 2, 3, 4, none]]
    assert packed.params.qkv_format == "thd"
    assert packed.params.cu_seqlens_q.tolist() == [0, 3, 4, 8]
    assert packed.params.max_seqlen_q == 4

    values = torch.arange(8.0).reshape(1, 8, 1).requires_grad_(True)
    out = packing.unpack(packed, values)
    assert out[..., 0].tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    out.sum().backward()
    assert values.grad.flatten().tolist() == [1.0] * 8  # every packed token used once


def test_pack_pads_to_a_multiple_with_a_filler_sequence():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    packed = packing.pack(ids, (ids != 0).long(), multiple=4)
    assert packed.input_ids.shape == (1, 8)
    # The filler is a sequence of its own (it attends only to itself) without targets.
    assert packed.params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert packed.labels[0, 5:].tolist() == [token_scores.NO_TARGET] * 3
