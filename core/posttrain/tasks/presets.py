"""Tiny models that posttrain builds locally (no download), for tests, examples and benchmarks.

``model_name_or_path: preset:NAME`` resolves to an HF directory built once, deterministically,
under ``$POSTTRAIN_CACHE`` (default ``~/.cache/posttrain``). Everything downstream loads it through
the same code path as a real HF checkpoint.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

import attrs

from posttrain.errors import UserError
from posttrain.hf_progress import no_hf_progress_bars
from posttrain.tasks.vision import VISION_WARM_STEPS
from posttrain.tasks.warm_start import RECIPES, TOOL_TAGS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PRESET_PREFIX = "preset:"
# Small alphabet: digits, arithmetic signs and a space; chance of one right digit is about 1/16.
ARITH_ALPHABET = [*"0123456789+-*=", " "]
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


@attrs.frozen(kw_only=True)
class Preset:
    # HF model_type: qwen2, qwen3, qwen3_moe or llama (see _ARCHS).
    arch: str = "qwen2"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int | None = None
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = True
    # Mixture of experts (arch qwen3_moe): experts per MoE layer, experts each token is routed
    # to, and each expert's MLP width (every layer is an MoE layer).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    seed: int = 0
    # "lm": a causal LM; "score": a sequence classifier with one label (a reward model).
    head: str = "lm"
    # Tokens added to the arithmetic alphabet, one token each; not special, so decoding keeps them.
    added_tokens: tuple[str, ...] = ()
    # A supervised pass after initialisation: a key of posttrain.tasks.warm_start.RECIPES.
    warm_start: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(RECIPES))
    )
    # Vision-language presets (arch qwen2_vl): supervised count_shapes steps after
    # initialisation (posttrain.tasks.vision.warm_start_count_shapes); 0: none.
    vision_warm_steps: int = 0
    description: str = ""


PRESETS: dict[str, Preset] = {
    "tiny-qwen2": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        description="Qwen2, hidden 64, 2 layers, arithmetic alphabet",
    ),
    # Head size 32, the smallest vLLM's CPU attention has kernels for; one layer, and a narrow
    # MLP keep a step as cheap as tiny-qwen2's, and it learns the quickstart task faster.
    "tiny-qwen2-head32": Preset(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        description="Qwen2, hidden 128, 1 layer, 4 heads of 32, arithmetic alphabet",
    ),
    # A reward model with a random score head: scores differ between samples, which is what
    # tests of the reward role need (it teaches nothing).
    "tiny-qwen2-reward": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        seed=3,
        head="score",
        description="Qwen2 sequence classifier (one label), hidden 64, 2 layers, random head",
    ),
    "small-qwen2": Preset(
        hidden_size=256,
        num_hidden_layers=4,
        description="Qwen2, hidden 256, 4 layers, arithmetic alphabet",
    ),
    # Qwen3's q/k norms, untied output layer (the seed 000 shrunk workflow).
    "tiny-qwen3": Preset(
        arch="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        description="Qwen3 (q/k norms), hidden 64, 2 layers, arithmetic alphabet",
    ),
    # Qwen3-MoE's sparse blocks (a router's top-2 of 8 experts, renormalised, as Qwen3-30B-A3B
    # renormalises its top-8 of 128) in both layers: routing replay's CPU tests and
    # examples/quickstart_moe.yaml.
    "tiny-qwen3-moe": Preset(
        arch="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        description="Qwen3-MoE, hidden 64, 2 layers of 8 experts (top-2), arithmetic alphabet",
    ),
    # Two layers: copying the calculator's result digit by digit takes an induction-like circuit,
    # which one layer learns far more slowly. A GRPO step of 16 prompts x 8 samples is cheap on CPU.
    "tiny-qwen2-calculator": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        added_tokens=TOOL_TAGS,
        warm_start="calculator",
        description=(
            "Qwen2, hidden 64, 2 layers, arithmetic alphabet and calculator tags, warm-started to "
            "call the calculator in about 1 answer of 4 and copy its result"
        ),
    ),
    # The calculator preset's geometry and tags, warm-started on long sums whose call is the
    # sum itself: python_sandbox with echo_last_expression runs it (examples/python_tool.yaml).
    "tiny-qwen2-python": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        added_tokens=TOOL_TAGS,
        warm_start="python_long_sum",
        description=(
            "Qwen2, hidden 64, 2 layers, arithmetic alphabet and call tags, warm-started to "
            "send a long sum to the python tool in about 1 answer of 4 and copy its output"
        ),
    ),
    # The calculator preset for vLLM, whose CPU attention has no kernel for head size 16: the
    # head-32 geometry, warm-started by the same recipe (tests/vllm/test_vllm_multiturn.py).
    "tiny-qwen2-head32-calculator": Preset(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        added_tokens=TOOL_TAGS,
        warm_start="calculator",
        description=(
            "tiny-qwen2-head32 with calculator tags, warm-started as tiny-qwen2-calculator "
            "(for vLLM on CPU)"
        ),
    ),
    # Qwen2-VL (a one-block vision tower of 8-pixel patches merged 2x2, mrope) on the
    # arithmetic alphabet and the vision tokens, with its image processor saved beside it: the
    # vision-language path's CPU tests (random weights).
    "tiny-qwen2-vl": Preset(
        arch="qwen2_vl",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=256,
        description="Qwen2-VL, hidden 64, 2 layers, one-block vision tower, 32x32 images",
    ),
    # tiny-qwen2-vl warm-started on count_shapes (examples/vision_quickstart.yaml).
    "tiny-qwen2-vl-count": Preset(
        arch="qwen2_vl",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=256,
        vision_warm_steps=VISION_WARM_STEPS,
        description=(
            "tiny-qwen2-vl warm-started on count_shapes (how many red squares) to a partial "
            "accuracy"
        ),
    ),
}
_VERSION = "v2"  # bump when a preset's construction changes, so caches are rebuilt


def is_preset(name: str | None) -> bool:
    return name is not None and name.startswith(PRESET_PREFIX)


def preset_name(name: str) -> str:
    key = name[len(PRESET_PREFIX) :]
    if key not in PRESETS:
        raise UserError(f"unknown preset '{key}'; available: {', '.join(sorted(PRESETS))}")
    return key


def cache_root() -> str:
    return os.environ.get(
        "POSTTRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "posttrain")
    )


def preset_path(name: str) -> str:
    """The HF directory of preset ``preset:KEY``, building it on first use (atomically)."""
    key = preset_name(name)
    target = os.path.join(cache_root(), "presets", _dir_name(key))
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(target))
    # A warm-started preset trains for up to a minute: say so, or the first run looks stuck.
    print(f"{PRESET_PREFIX}{key}: {_building(PRESETS[key])}", file=sys.stderr, flush=True)
    build_preset(PRESETS[key], tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _building(preset: Preset) -> str:
    if preset.vision_warm_steps:
        return f"building it once: {preset.vision_warm_steps} warm-start steps, then cached"
    if preset.warm_start is None:
        return "building it once (a few seconds; no download), then it is cached"
    recipe = RECIPES[preset.warm_start]
    return (
        f"building it once: {recipe.steps} steps of warm-start training, about "
        f"{recipe.about_s} s on one CPU core (no download), then it is cached"
    )


def _dir_name(key: str) -> str:
    """The cache directory's name; it names the warm-start recipe's version, so a changed recipe
    is rebuilt."""
    recipe = PRESETS[key].warm_start
    return f"{key}-{_VERSION}" + (f"-{recipe}{RECIPES[recipe].version}" if recipe else "")


# Qwen2's pre-tokenizer pattern (transformers' Qwen2Tokenizer): the presets' tokenizers use
# Qwen2's whole pipeline, because transformers 5's AutoTokenizer rebuilds any model_type qwen2
# directory's tokenizer as a Qwen2Tokenizer from its vocabulary. With the same pipeline, every way
# of loading a preset or an exported model (load_tokenizer, AutoTokenizer, an engine's own
# loader) encodes alike: one character, one token; a character outside the vocabulary has no
# token and is dropped, as Qwen2Tokenizer drops it.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(added_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges over the arithmetic alphabet: one character,
    one token; each of ``added_tokens`` is one token too."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    # The byte-level alphabet's name of each character (" " is "Ġ").
    alphabet = [byte_level.pre_tokenize_str(c)[0][0] for c in ARITH_ALPHABET]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [pre.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"), byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in added_tokens])
    return tokenizer


# arch -> (config class, model class) in transformers.
_ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def _arch_kwargs(preset: Preset) -> dict[str, int | bool]:
    """Config fields only some families have."""
    if preset.arch not in ("qwen3", "qwen3_moe"):
        return {}
    # Qwen3's default head_dim is 128, not hidden / heads.
    kwargs: dict[str, int | bool] = {"head_dim": preset.hidden_size // preset.num_attention_heads}
    if preset.arch == "qwen3_moe":
        kwargs.update(
            num_experts=preset.num_experts,
            num_experts_per_tok=preset.num_experts_per_tok,
            moe_intermediate_size=preset.moe_intermediate_size or preset.hidden_size,
            norm_topk_prob=True,
        )
    return kwargs


def build_preset(preset: Preset, out_dir: str) -> None:
    import torch
    import transformers

    if preset.arch == "qwen2_vl":
        _build_vision_preset(preset, out_dir)
        return
    config_name, model_name = _ARCHS[preset.arch]
    tokenizer = build_tokenizer(preset.added_tokens)
    config = getattr(transformers, config_name)(
        **_arch_kwargs(preset),
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size or 4 * preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(preset.seed)
    try:
        if preset.head == "score":
            config.num_labels = 1
            model = transformers.AutoModelForSequenceClassification.from_config(config)
        else:
            model = getattr(transformers, model_name)(config)
        model = model.to(torch.float32)
        if preset.warm_start is not None:
            RECIPES[preset.warm_start].train(model, tokenizer)
    finally:
        torch.random.set_rng_state(state)
    with no_hf_progress_bars():
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _keep_tokenizer_class(out_dir)


def _build_vision_preset(preset: Preset, out_dir: str) -> None:
    """A Qwen2-VL preset: the arithmetic tokenizer with the vision tokens (special: one token
    each), the model and its image processor."""
    import torch

    from posttrain.tasks.vision import VISION_TOKENS, build_vision_model, warm_start_count_shapes

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    state = torch.random.get_rng_state()
    torch.manual_seed(preset.seed)
    try:
        model, image_processor = build_vision_model(
            tokenizer,
            hidden_size=preset.hidden_size,
            num_hidden_layers=preset.num_hidden_layers,
            num_attention_heads=preset.num_attention_heads,
            num_key_value_heads=preset.num_key_value_heads,
            intermediate_size=preset.intermediate_size or 4 * preset.hidden_size,
            max_position_embeddings=preset.max_position_embeddings,
        )
        model = model.to(torch.float32)
        if preset.vision_warm_steps:
            warm_start_count_shapes(model, tokenizer, image_processor, preset.vision_warm_steps)
    finally:
        torch.random.set_rng_state(state)
    with no_hf_progress_bars():
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    _keep_tokenizer_class(out_dir)


def _keep_tokenizer_class(out_dir: str) -> None:
    """transformers 5 would otherwise load the tokenizer as Qwen2Tokenizer from the model
    config."""
    import json

    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
