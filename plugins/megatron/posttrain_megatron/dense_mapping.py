"""HF tensor names and layouts <-> megatron-core GPTModel parameters, one tensor-parallel shard
at a time (pure tensor code; the collectives are :mod:`posttrain_megatron.dense_bridge`'s).

Layouts on megatron's side (TP ranks split dimension 0 of column-parallel weights, dimension 1 of
row-parallel ones):

* ``linear_qkv`` packs q, k and v per query group: for each group, its ``heads / groups`` query
  heads, then its key head, then its value head (``[groups, (heads/groups + 2) * head_dim, ...]``
  flattened); TP ranks own contiguous groups. Biases follow the same layout.
* ``linear_fc1`` packs SwiGLU's gate and up projections per TP rank: a rank's shard is its gate
  rows followed by its up rows (megatron-core's GLU chunks the local output in two).
* ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are row-parallel.
* the embedding and output layer split the vocabulary, padded with zero rows to a multiple of TP.
* norms (and Qwen3's per-head q/k norms) are replicated.

Module names are those of the layer spec this plugin builds (``input_layernorm`` /
``pre_mlp_layernorm`` as modules); TransformerEngine's spec fuses those norms into
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, mapped the same.
"""

from __future__ import annotations

import re

import attrs
import torch

REPLICATED, ROW, VOCAB, QKV, GATE_UP = "replicated", "row", "vocab", "qkv", "gate_up"

_LAYER_PARAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), REPLICATED),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), REPLICATED),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        QKV,
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), REPLICATED),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), REPLICATED),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ROW),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), REPLICATED),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), REPLICATED),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), ROW),
}
_TOP_PARAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), VOCAB),
    "decoder.final_layernorm.weight": (("model.norm.weight",), REPLICATED),
    "output_layer.weight": (("lm_head.weight",), VOCAB),
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@attrs.frozen(kw_only=True)
class Dims:
    """What the layouts depend on: attention shape, vocabulary, tensor-parallel size."""

    heads: int
    groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied: bool
    tp: int


def global_name(local_name: str, layer_numbers: dict[int, int]) -> str:
    """A chunk's parameter name with its layer index made global (``layer_numbers``: local index
    -> global index, from each layer's ``layer_number``: pipeline stages own layer ranges)."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    return f"decoder.layers.{layer_numbers[int(match.group(1))]}.{match.group(2)}"


def hf_names(name: str, tied: bool) -> tuple[tuple[str, ...], str]:
    """The HF tensors behind global megatron parameter ``name``, and the layout kind."""
    match = _LAYER.match(name)
    if match is not None:
        entry = _LAYER_PARAMS.get(match.group(2))
        prefix = f"model.layers.{match.group(1)}."
    else:
        entry = _TOP_PARAMS.get(name)
        prefix = ""
    if entry is None:
        raise ValueError(f"megatron: no HF tensor maps to parameter {name!r}")
    names, kind = entry
    if name == "output_layer.weight" and tied:
        # The last pipeline stage's copy of a tied embedding.
        return ("model.embed_tokens.weight",), kind
    return tuple(prefix + n for n in names), kind


def to_shard(kind: str, hf: list[torch.Tensor], dims: Dims, rank: int) -> torch.Tensor:
    """This TP rank's megatron shard from the full HF tensors (in :func:`hf_names` order)."""
    if kind == REPLICATED:
        return hf[0]
    if kind == ROW:
        return hf[0].chunk(dims.tp, dim=1)[rank]
    if kind == VOCAB:
        full = hf[0]
        pad = dims.padded_vocab_size - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
        return full.chunk(dims.tp, dim=0)[rank]
    if kind == GATE_UP:
        gate, up = (t.chunk(dims.tp, dim=0)[rank] for t in hf)
        return torch.cat([gate, up])
    if kind == QKV:
        q, k, v = hf
        rest = q.shape[1:]
        per_group = dims.heads // dims.groups * dims.head_dim
        packed = torch.cat(
            [
                q.reshape(dims.groups, per_group, *rest),
                k.reshape(dims.groups, dims.head_dim, *rest),
                v.reshape(dims.groups, dims.head_dim, *rest),
            ],
            dim=1,
        )
        return packed.chunk(dims.tp, dim=0)[rank].reshape(-1, *rest)
    raise ValueError(f"unknown layout {kind!r}")


def from_shards(kind: str, shards: list[torch.Tensor], dims: Dims) -> list[torch.Tensor]:
    """The full HF tensors (in :func:`hf_names` order) from every TP rank's shard."""
    if kind == REPLICATED:
        return [shards[0]]
    if kind == ROW:
        return [torch.cat(shards, dim=1)]
    if kind == VOCAB:
        return [torch.cat(shards, dim=0)[: dims.vocab_size]]
    if kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == QKV:
        rest = shards[0].shape[1:]
        per_group = dims.heads // dims.groups * dims.head_dim
        packed = torch.cat(
            [s.reshape(-1, per_group + 2 * dims.head_dim, *rest) for s in shards], dim=0
        )
        q, k, v = packed.split([per_group, dims.head_dim, dims.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise ValueError(f"unknown layout {kind!r}")


def hf_shapes(kind: str, shard_shape: tuple[int, ...], dims: Dims) -> list[tuple[int, ...]]:
    """The shapes :func:`from_shards` returns, from one shard's shape (no communication)."""
    rest = tuple(shard_shape[1:])
    if kind == REPLICATED:
        return [tuple(shard_shape)]
    if kind == ROW:
        return [(shard_shape[0], shard_shape[1] * dims.tp, *shard_shape[2:])]
    if kind == VOCAB:
        return [(dims.vocab_size, *rest)]
    if kind == GATE_UP:
        half = shard_shape[0] // 2 * dims.tp
        return [(half, *rest), (half, *rest)]
    if kind == QKV:
        return [
            (dims.heads * dims.head_dim, *rest),
            (dims.groups * dims.head_dim, *rest),
            (dims.groups * dims.head_dim, *rest),
        ]
    raise ValueError(f"unknown layout {kind!r}")
