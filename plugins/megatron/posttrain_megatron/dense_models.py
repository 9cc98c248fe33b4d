"""The dense HF model families this plugin converts itself (``use_mbridge: false``).

Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (q/k RMSNorm per head, no bias) and Llama (no bias; Llama 3's
rope scaling) are one megatron-core GPTModel each: RMSNorm, SwiGLU, rotary embeddings, grouped
query attention. This module reads an HF config (a ``transformers`` config object or the plain
``config.json`` mapping ``posttrain validate`` has) and says whether it is one of them
(:func:`unsupported_reason`, torch-free), and what megatron-core builds for it
(:func:`transformer_config_kwargs`, :func:`gpt_model_kwargs`). Mixture-of-experts models are not
converted here: mbridge or a dist checkpoint made by ``posttrain convert`` loads them.
"""

from __future__ import annotations

from typing import Any

DENSE_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# Llama 3's rope scaling as megatron-core implements it (RotaryEmbedding._apply_scaling): only
# the factor is a parameter; the other three are fixed.
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def num_experts(config: Any) -> int:
    for key in _EXPERT_KEYS:
        value = _get(config, key)
        if value:
            return int(value)
    return 0


def rope(config: Any) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope parameters)``: transformers 5 keeps both under ``rope_parameters``,
    older releases have ``rope_theta`` and ``rope_scaling``."""
    params = dict(_get(config, "rope_parameters") or _get(config, "rope_scaling") or {})
    theta = _get(config, "rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta), params


def unsupported_reason(config: Any) -> str | None:
    """Why the plugin's own converter cannot build this model (None: it can)."""
    model_type = _get(config, "model_type")
    if num_experts(config):
        return (
            f"{model_type or 'this model'} is a mixture-of-experts model: its weights load "
            "through mbridge or from a Megatron dist checkpoint, not the plugin's dense converter"
        )
    if model_type not in DENSE_MODEL_TYPES:
        return (
            f"model_type {model_type!r} has no converter in the megatron plugin (dense "
            f"{', '.join(DENSE_MODEL_TYPES)} only)"
        )
    if _get(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {_get(config, 'hidden_act')!r}: only SwiGLU (silu) MLPs are converted"
    if _get(config, "use_sliding_window"):
        return "sliding-window attention has no megatron-core counterpart here"
    if _get(config, "mlp_bias"):
        return "MLP biases (mlp_bias: true) are not converted"
    if model_type != "qwen2" and _get(config, "attention_bias"):
        # Such models also bias o_proj; megatron-core ties that bias to the MLP's (add_bias_linear).
        return "attention_bias: true (a biased o_proj) is not converted"
    _, params = rope(config)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "llama3":
        odd = {k: params.get(k) for k, v in _LLAMA3_ROPE_FIXED.items() if params.get(k) != v}
        if odd:
            return f"llama3 rope scaling with {odd}: megatron-core fixes {_LLAMA3_ROPE_FIXED}"
    elif kind != "default":
        return f"rope_type {kind!r} is not converted (default and llama3 are)"
    return None


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """The model-shape fields of megatron-core's TransformerConfig for ``hf_config``."""
    import torch.nn.functional as F

    heads = hf_config.num_attention_heads
    return {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": heads,
        "num_query_groups": _get(hf_config, "num_key_value_heads") or heads,
        "kv_channels": _get(hf_config, "head_dim") or hf_config.hidden_size // heads,
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "normalization": "RMSNorm",
        "activation_func": F.silu,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        # Qwen2's q/k/v projections are biased (its o_proj is not).
        "add_qkv_bias": hf_config.model_type == "qwen2",
        "qk_layernorm": hf_config.model_type == "qwen3",
        "attention_dropout": float(_get(hf_config, "attention_dropout", 0.0) or 0.0),
        "hidden_dropout": 0.0,
    }


def gpt_model_kwargs(hf_config: Any, padded_vocab_size: int) -> dict[str, Any]:
    """GPTModel's own arguments (embedding, rotary, tying) for ``hf_config``."""
    theta, params = rope(hf_config)
    llama3 = (params.get("rope_type") or params.get("type")) == "llama3"
    return {
        "vocab_size": padded_vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rope_scaling": llama3,
        "rope_scaling_factor": float(params.get("factor", 8.0)) if llama3 else 8.0,
        "share_embeddings_and_output_weights": bool(_get(hf_config, "tie_word_embeddings")),
    }
