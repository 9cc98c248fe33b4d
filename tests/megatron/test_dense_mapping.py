"""The dense converter's tensor layouts and model checks, without ranks (pure tensors).

Loading and export through real megatron-core ranks: test_megatron_models.py (logits equal
HF's) and the megatron contract (use_mbridge: false)."""

from __future__ import annotations

import pytest
import torch

from posttrain_megatron import dense_mapping as dm
from posttrain_megatron.dense_models import unsupported_reason


def _dims(tp: int) -> dm.Dims:
    return dm.Dims(
        heads=8, groups=2, head_dim=4, vocab_size=31, padded_vocab_size=32, tied=False, tp=tp
    )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "kind, shapes",
    [
        (dm.QKV, [(32, 16), (8, 16), (8, 16)]),
        (dm.QKV, [(32,), (8,), (8,)]),  # q/k/v biases
        (dm.GATE_UP, [(24, 16), (24, 16)]),
        (dm.ROW, [(16, 32)]),
        (dm.VOCAB, [(31, 16)]),
        (dm.REPLICATED, [(16,)]),
    ],
)
def test_shards_round_trip_exactly(kind, shapes, tp):
    dims = _dims(tp)
    gen = torch.Generator().manual_seed(0)
    hf = [torch.randn(s, generator=gen) for s in shapes]
    shards = [dm.to_shard(kind, hf, dims, rank) for rank in range(tp)]
    back = dm.from_shards(kind, shards, dims)
    assert [tuple(t.shape) for t in back] == dm.hf_shapes(kind, tuple(shards[0].shape), dims)
    assert all(torch.equal(a, b) for a, b in zip(hf, back))


def test_qkv_packs_query_groups_in_megatron_order():
    """Group g's rows: its 4 query heads, then its key head, then its value head; TP rank r owns
    group r."""
    dims = _dims(2)
    q = torch.arange(8).repeat_interleave(4).float()  # head index per row
    k = 100 + torch.arange(2).repeat_interleave(4).float()
    v = 200 + torch.arange(2).repeat_interleave(4).float()
    shard = dm.to_shard(dm.QKV, [q, k, v], dims, rank=1)
    heads = shard.reshape(-1, 4)[:, 0].tolist()
    assert heads == [4.0, 5.0, 6.0, 7.0, 101.0, 201.0]


def test_names_map_layers_and_the_tied_output_layer():
    assert dm.global_name("decoder.layers.1.mlp.linear_fc2.weight", {1: 5}) == (
        "decoder.layers.5.mlp.linear_fc2.weight"
    )
    names, kind = dm.hf_names("decoder.layers.5.self_attention.linear_qkv.bias", tied=False)
    assert kind == dm.QKV and names[0] == "model.layers.5.self_attn.q_proj.bias"
    assert dm.hf_names("output_layer.weight", tied=True)[0] == ("model.embed_tokens.weight",)
    assert dm.hf_names("output_layer.weight", tied=False)[0] == ("lm_head.weight",)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"model_type": "qwen2"}, None),
        ({"model_type": "qwen3", "attention_bias": False}, None),
        (
            {
                "model_type": "llama",
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            None,
        ),
        ({"model_type": "qwen3_moe", "num_experts": 128}, "mixture-of-experts"),
        ({"model_type": "gemma"}, "no converter"),
        ({"model_type": "llama", "attention_bias": True}, "biased o_proj"),
        ({"model_type": "qwen2", "rope_parameters": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
    ],
)
def test_unsupported_reason(config, fragment):
    reason = unsupported_reason(config)
    assert reason is None if fragment is None else fragment in reason
