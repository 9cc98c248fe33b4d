"""In-memory Qwen2 models for unit tests that need a real transformers module but no files
(random init, seeded; the file-backed presets come from the session fixtures in conftest)."""

from __future__ import annotations

SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_qwen2(seed: int = 0, **config):
    """A ``Qwen2ForCausalLM`` of :data:`SIZES`, any of them (or another config field)
    overridden by ``config``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**SIZES, **config}))
