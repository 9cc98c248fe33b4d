"""A model's geometry (widths, depths, vocabulary) read from its config without loading it.

The memory plan needs only numbers a ``config.json`` holds. They come from a local HF directory,
a built-in preset's definition (no build needed) or, for a hub id, the local HF cache; never from
the network, and never through torch.
"""

from __future__ import annotations

import json
import os

import attrs


@attrs.frozen(kw_only=True)
class ModelGeometry:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v biases (Qwen2's)
    qk_norm: bool = False  # per-head RMS norms of queries and keys (Qwen3's)
    # Mixture of experts (0 experts: a dense model): routed experts per MoE layer, the experts
    # a token runs through, each expert's MLP width, a shared expert's width (Qwen2-MoE's; 0:
    # none) and the layers that keep a dense MLP (Qwen-MoE's mlp_only_layers).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0

    @property
    def kv_width(self) -> int:
        """Width of one of a layer's key or value projections (all KV heads)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.dense_layers if self.num_experts else 0

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters over every layer (what expert parallelism splits)."""
        return (
            self.moe_layers
            * self.num_experts
            * 3
            * self.hidden_size
            * self.expert_intermediate_size
        )

    @property
    def params(self) -> int:
        """Parameters, as transformers counts them (the tied embedding once)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.kv_width
        attention = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * self.head_dim
        dense = self.num_hidden_layers - self.moe_layers
        # An MoE layer: its router and shared expert (with its one-output gate) beside the
        # routed experts.
        shared = self.shared_expert_intermediate_size
        moe = self.num_experts * h + (3 * h * shared + h if shared else 0)
        layers = self.num_hidden_layers * (attention + 2 * h)
        layers += dense * 3 * h * self.intermediate_size + self.moe_layers * moe
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + self.expert_params + embeddings + h

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width a token runs through: a dense model's, or its experts' and the shared
        expert's (what the activations hold per token)."""
        if not self.num_experts:
            return self.intermediate_size
        routed = self.experts_per_token * self.expert_intermediate_size
        return routed + self.shared_expert_intermediate_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return (self.params - self.vocab_size * self.hidden_size) // self.num_hidden_layers

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token over every layer."""
        return self.num_hidden_layers * 2 * self.kv_width * dtype_bytes


# Model types whose q/k/v projections have biases where the config does not say.
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


def geometry_from_config(config: dict) -> ModelGeometry | None:
    """The geometry in an HF ``config.json``'s dict; None where a field is missing (an
    architecture this plan does not know, e.g. one whose widths live under other names)."""
    text = config.get("text_config") or config
    model_type = text.get("model_type")
    experts = max(
        int(text.get(key) or 0) for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        intermediate = int(text.get("intermediate_size") or 4 * hidden)
        bias = text.get("attention_bias")
        return ModelGeometry(
            hidden_size=hidden,
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate_size=intermediate,
            vocab_size=int(text["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            attention_bias=bool(bias) if bias is not None else model_type in QKV_BIAS_TYPES,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            experts_per_token=int(text.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral's experts are intermediate_size wide; Qwen-MoE's moe_intermediate_size.
            expert_intermediate_size=int(text.get("moe_intermediate_size") or intermediate)
            if experts
            else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0)
            if experts
            else 0,
            dense_layers=len(text.get("mlp_only_layers") or ()) if experts else 0,
        )
    except (KeyError, TypeError, ValueError):
        return None


def read_geometry(model: str | None) -> ModelGeometry | None:
    """The geometry of ``model`` (a ``model_name_or_path``): a directory's ``config.json``, a
    preset's definition, or a hub id's ``config.json`` in the local HF cache. None when it cannot
    be known without the network or a build."""
    if not model:
        return None
    from posttrain.tasks.presets import is_preset

    if is_preset(model):
        return preset_geometry(model)
    local = os.path.join(model, "config.json")
    path = local if os.path.isfile(local) else _cached_hub_config(model)
    if path is None:
        return None
    with open(path) as f:
        return geometry_from_config(json.load(f))


def preset_geometry(name: str) -> ModelGeometry:
    """The geometry of preset ``preset:KEY`` from its definition (no build)."""
    from posttrain.tasks.presets import (
        ARITH_ALPHABET,
        PRESETS,
        SPECIAL_TOKENS,
        preset_name,
    )

    preset = PRESETS[preset_name(name)]
    hidden, heads = preset.hidden_size, preset.num_attention_heads
    # Qwen2 projects q/k/v with biases, Qwen3 normalises them (presets.build_preset's classes).
    return ModelGeometry(
        hidden_size=hidden,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=hidden // heads,
        intermediate_size=preset.intermediate_size or 4 * hidden,
        vocab_size=len(SPECIAL_TOKENS) + len(ARITH_ALPHABET) + len(preset.added_tokens),
        tie_word_embeddings=preset.tie_word_embeddings,
        attention_bias=preset.arch == "qwen2",
        qk_norm=preset.arch in ("qwen3", "qwen3_moe"),
        num_experts=preset.num_experts,
        experts_per_token=preset.num_experts_per_tok if preset.num_experts else 0,
        # As presets.build_preset builds it.
        expert_intermediate_size=(preset.moe_intermediate_size or hidden)
        if preset.num_experts
        else 0,
    )


def _cached_hub_config(repo_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # transformers brings it; a bare core install may not have it
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a repo id (a mistyped path, say): validation reports it
        return None
    return found if isinstance(found, str) else None
