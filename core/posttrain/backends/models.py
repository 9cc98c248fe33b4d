"""Loading HF models and tokenizers from a directory, a hub id or a preset: public API for backends.

Every backend loads a role's model and tokenizer through these functions, so that all of them
read ``model_args`` alike (presets, paths relative to the workflow, dtype, ``trust_remote_code``,
``attn_implementation``), the tokenizer is the one the driver decodes and rewards with, and a
critic or reward model gets the same head everywhere. An engine's ``load_model(worker)``
typically starts with::

    model = load_model_with_head(worker.model_args, worker.head, worker.base_dir, worker.device)

or, for an engine that loads weights itself, ``resolve_model_path(worker.model_args
.model_name_or_path, worker.base_dir)`` for the HF directory and ``torch_dtype`` for the dtype.

Importing this module is cheap (no torch, no transformers); each function imports what it needs
when called. The names below are kept stable for plugins: ``DTYPES``, ``HEAD_WEIGHT``,
:func:`torch_dtype`, :func:`resolve_model_path`, :func:`load_tokenizer`, :func:`load_causal_lm`,
:func:`load_model_with_head`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from posttrain.errors import UserError
from posttrain.hf_progress import no_hf_progress_bars
from posttrain.tasks.presets import is_preset, preset_path

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain.config.sections import ModelArgs

# ``ModelArgs.dtype`` (and a strategy's dtype options) -> the torch dtype's name.
DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a dtype name of :data:`DTYPES` (``"fp32"``, ``"bf16"``, ...);
    ``KeyError`` for any other (``ModelArgs.dtype`` is validated to be one)."""
    import torch

    return getattr(torch, DTYPES[name])


def resolve_model_path(name_or_path: str | None, base_dir: str = ".") -> str:
    """Where to load ``name_or_path`` from (as ``ModelArgs.model_name_or_path`` gives it).

    ``"preset:KEY"``: the preset's HF directory, built on first use under ``$POSTTRAIN_CACHE``
    (atomically: ranks may ask at once). A path that exists, absolute or relative to
    ``base_dir`` (pass ``worker.base_dir``, the workflow's directory): that path. Anything else
    is returned unchanged, as a hub id for transformers to download. Never raises for a path
    that does not exist (``posttrain validate`` reported it); imports torch only to build a
    preset. No model named at all (``None``) is a :class:`UserError`.
    """
    if not name_or_path:
        raise UserError("model_args.model_name_or_path is not set: name the model to load")
    if is_preset(name_or_path):
        return preset_path(name_or_path)
    local = name_or_path if os.path.isabs(name_or_path) else os.path.join(base_dir, name_or_path)
    return local if os.path.exists(local) else name_or_path


def load_tokenizer(model_args: ModelArgs, base_dir: str = ".") -> PreTrainedTokenizerBase:
    """The role's tokenizer: from ``tokenizer_name_or_path``, else ``model_name_or_path``
    (resolved as by :func:`resolve_model_path`), of the class it was saved with, with its pad
    token set to EOS when it has none. The driver decodes rollouts and builds reward-model
    batches with this same tokenizer, so a backend must use it (not its engine's own) wherever
    token ids meet text."""
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


def load_causal_lm(
    model_args: ModelArgs, base_dir: str = ".", device: str = "cpu", tp_mesh: Any = None
) -> PreTrainedModel:
    """An ``AutoModelForCausalLM`` of ``model_args`` (its dtype, ``trust_remote_code`` and
    ``attn_implementation``) on ``device``, in eval mode as transformers returns it, loaded
    without progress bars (they would fill the rank logs). With ``tp_mesh`` (a 1-D device
    mesh), split over its ranks by the model's tensor-parallel plan (``tp_plan="auto"``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = resolve_model_path(model_args.model_name_or_path, base_dir)
    # A vision-language model (Qwen2-VL style) is no AutoModelForCausalLM in transformers 5: its
    # image-text-to-text class, whose forward takes the images and returns the logits.
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    auto = (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    kwargs = {
        "dtype": torch_dtype(model_args.dtype),
        "trust_remote_code": model_args.trust_remote_code,
    }
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if tp_mesh is not None:
        kwargs |= {"tp_plan": "auto", "device_mesh": tp_mesh}
    with no_hf_progress_bars():
        model = auto.from_pretrained(path, **kwargs)
    return model if tp_mesh is not None else model.to(device)


# The value head's HF name (``*ForTokenClassification`` / ``*ForSequenceClassification``).
HEAD_WEIGHT = "score.weight"


def load_model_with_head(
    model_args: ModelArgs, head: str, base_dir: str = ".", device: str = "cpu"
) -> PreTrainedModel:
    """The model a role runs, by its head (``worker.head``): a causal LM (``"lm"``, as
    :func:`load_causal_lm`), a value model (``"value"``: a critic; an
    ``AutoModelForTokenClassification`` with one bias-free output per token, named
    :data:`HEAD_WEIGHT`, and no dropout) or a reward model (``"score"``: an
    ``AutoModelForSequenceClassification`` with one label). A value head the weights lack
    starts at zero, so every backend starts a critic alike (and at V = 0). On ``device``, in
    eval mode; ``ValueError`` for another head."""
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
            # (posttrain.scoring.modeling.sequence_scores pools by the attention mask).
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
