"""preset:tiny-qwen2-calculator: tool tags are single tokens, the warm start trains only the
model's tokens and builds reproducibly, and the built model calls the calculator sometimes and
copies its result."""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from posttrain.tasks import presets
from posttrain.tasks.warm_start import CALL, END_CALL, END_RESULT, RECIPES, RESULT, TOOL_TAGS

EPISODE = f"37*48={CALL}37*48{END_CALL}{RESULT}1776{END_RESULT}1776"


def test_tool_tags_are_single_tokens_and_decoding_keeps_them():
    tokenizer = presets.build_tokenizer(TOOL_TAGS)
    ids = tokenizer.encode(f"{CALL}12*3{END_CALL}", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [CALL, "1", "2", "*", "3", END_CALL]
    ids = [*tokenizer.encode(EPISODE, add_special_tokens=False), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == EPISODE


def test_episodes_train_the_models_tokens_only():
    recipe = RECIPES["calculator"]
    tokenizer = presets.build_tokenizer(TOOL_TAGS)
    rng = random.Random(0)
    rows = [recipe._encode(rng, tokenizer) for _ in range(200)]
    calls = [row for row in rows if tokenizer.convert_tokens_to_ids(CALL) in row[0]]
    assert 0.15 < len(calls) / len(rows) < 0.35
    ids, mask = calls[0]
    text = tokenizer.convert_ids_to_tokens(ids)
    trained = "".join(t for t, m in zip(text, mask) if m)
    untrained = "".join(t for t, m in zip(text, mask) if not m)
    prompt, _, rest = "".join(text).partition(CALL)
    answer = rest.rsplit(END_RESULT, 1)[1].removesuffix("<eos>")
    assert untrained == f"{prompt}{RESULT}{answer}{END_RESULT}"
    assert trained == f"{CALL}{prompt.removesuffix('=')}{END_CALL}{answer}<eos>"
    assert int(answer) == eval(prompt.removesuffix("="))  # the tool's result is right
    ids, mask = next(row for row in rows if row not in calls)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    prompt, answer = text.split("=")
    assert int(answer) != eval(prompt)  # answering alone is wrong
    assert sum(mask) == len(answer) + 1  # the answer and <eos>


def test_build_is_reproducible_and_a_changed_recipe_gets_a_new_cache_dir(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    short = attrs.evolve(RECIPES["calculator"], steps=2, batch_size=8)
    monkeypatch.setitem(RECIPES, "calculator", short)
    preset = presets.PRESETS["tiny-qwen2-calculator"]
    for name, spec in (
        ("a", preset),
        ("b", preset),
        ("init", attrs.evolve(preset, warm_start=None)),
    ):
        presets.build_preset(spec, str(tmp_path / name))
    a, b, init = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b", "init"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], init[k]) for k in a)  # the warm start ran

    before = presets._dir_name("tiny-qwen2-calculator")
    monkeypatch.setitem(RECIPES, "calculator", attrs.evolve(short, version="next"))
    assert presets._dir_name("tiny-qwen2-calculator") != before


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_warm_started_model_calls_the_tool_sometimes_and_copies_its_result(posttrain_cache):
    """Greedy and exact probabilities, not samples: the same verdict on every machine."""
    from posttrain.backends.models import load_causal_lm, load_tokenizer
    from posttrain.config.sections import ModelArgs
    from posttrain.tasks.data import synthetic_multi_digit_arithmetic

    args = ModelArgs(model_name_or_path=presets.preset_path("preset:tiny-qwen2-calculator"))
    tokenizer, model = load_tokenizer(args), load_causal_lm(args).eval()
    records = synthetic_multi_digit_arithmetic()[:32]
    call_id = tokenizer.convert_tokens_to_ids(CALL)

    def greedy(text: str, **kwargs) -> str:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        out = model.generate(ids, do_sample=False, max_new_tokens=12, **kwargs)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    with torch.no_grad():
        p_call = [
            torch.softmax(model(torch.tensor([tokenizer.encode(r["prompt"])])).logits[0, -1], -1)[
                call_id
            ].item()
            for r in records
        ]
        end_call = tokenizer.convert_tokens_to_ids(END_CALL)
        calls = [greedy(r["prompt"] + CALL, eos_token_id=end_call) for r in records]
        copies = [
            greedy(
                f"{r['prompt']}{CALL}{r['prompt'][:-1]}{END_CALL}{RESULT}{r['answer']}{END_RESULT}"
            )
            for r in records
        ]
        alone = [greedy(r["prompt"], bad_words_ids=[[call_id]]) for r in records]
    assert 0.15 < sum(p_call) / len(records) < 0.35
    assert sum(c == f"{r['prompt'][:-1]}{END_CALL}" for c, r in zip(calls, records)) >= 28
    assert sum(c == r["answer"] for c, r in zip(copies, records)) >= 28
    assert sum(a == r["answer"] for a, r in zip(alone, records)) <= 3
