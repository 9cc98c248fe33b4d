"""Loading HF models and tokenizers from a directory, a hub id or a preset (the real path)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from posttrain.hf_progress import no_hf_progress_bars
from posttrain.presets import is_preset, preset_path

if TYPE_CHECKING:
    from posttrain.config.sections import ModelArgs

DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def resolve_model_path(name_or_path: str, base_dir: str = ".") -> str:
    """A preset's built directory, a local directory (relative to the workflow), or a hub id."""
    if is_preset(name_or_path):
        return preset_path(name_or_path)
    local = name_or_path if os.path.isabs(name_or_path) else os.path.join(base_dir, name_or_path)
    return local if os.path.exists(local) else name_or_path


def load_tokenizer(model_args: ModelArgs, base_dir: str = "."):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = resolve_model_path(
        model_args.tokenizer_name_or_path or model_args.model_name_or_path, base_dir
    )
    # transformers 5's AutoTokenizer picks the class from the *model* config and would load a
    # generic fast tokenizer as e.g. Qwen2Tokenizer, changing its vocabulary; honour the class
    # the tokenizer was saved with.
    if _saved_tokenizer_class(path) == "PreTrainedTokenizerFast":
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=model_args.trust_remote_code
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(model_args: ModelArgs, base_dir: str = ".", device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_args.model_name_or_path, base_dir)
    kwargs = {
        "dtype": torch_dtype(model_args.dtype),
        "trust_remote_code": model_args.trust_remote_code,
    }
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    with no_hf_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device)


# The value head's HF name (``*ForTokenClassification`` / ``*ForSequenceClassification``).
HEAD_WEIGHT = "score.weight"


def load_model_with_head(model_args: ModelArgs, head: str, base_dir: str = ".", device="cpu"):
    """The model a role runs: a causal LM (``head="lm"``), a value model (``"value"``: a
    critic, one bias-free linear output per token, no dropout) or a reward model (``"score"``:
    a sequence classifier with one label). A value head the weights lack starts at zero, so
    every backend starts a critic alike (and at V = 0)."""
    if head == "lm":
        return load_causal_lm(model_args, base_dir, device)
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    path = resolve_model_path(model_args.model_name_or_path, base_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    config.num_labels = 1
    kwargs = {
        "config": config,
        "dtype": torch_dtype(model_args.dtype),
        "trust_remote_code": model_args.trust_remote_code,
    }
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if head == "score":
        if config.pad_token_id is None:
            # transformers refuses batches without one; its pooling by pad id is not used
            # (posttrain.modeling.sequence_scores pools by the attention mask).
            config.pad_token_id = 0
        with no_hf_progress_bars():
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        return model.to(device)
    if head != "value":
        raise ValueError(f"unknown model head {head!r}")
    config.classifier_dropout = 0.0
    config.token_classification_bias = False
    with no_hf_progress_bars():
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, output_loading_info=True, **kwargs
        )
    if HEAD_WEIGHT in info["missing_keys"]:
        import torch

        with torch.no_grad():
            model.score.weight.zero_()
    return model.to(device)


def _saved_tokenizer_class(path: str) -> str | None:
    import json

    cfg = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        return json.load(f).get("tokenizer_class")
