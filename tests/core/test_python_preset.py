"""preset:tiny-qwen2-python's data: the long_sum task, and a warm start that teaches the copy in
most episodes but the decision to call in about 1 of 4 (the end-to-end test trains from it)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from posttrain.config.data_sections import SyntheticData
from posttrain.tasks import presets
from posttrain.tasks.data import SYNTHETIC_TASKS
from posttrain.tasks.warm_start import CALL, RECIPES, TOOL_TAGS


def test_long_sum_problems_are_5_or_6_terms_of_2_or_3_digits():
    records = SYNTHETIC_TASKS["long_sum"](SyntheticData(task="long_sum"))
    assert len({r["prompt"] for r in records}) == len(records) == 1024
    for record in records:
        terms = record["prompt"].removesuffix("=").split("+")
        assert len(terms) in (5, 6) and all(len(t) in (2, 3) for t in terms)
        assert int(record["answer"]) == sum(map(int, terms))
    counts = [len(r["prompt"].split("+")) for r in records]
    assert 5.3 < statistics.mean(counts) < 5.7


def test_the_decision_to_call_is_trained_in_1_episode_of_4_the_copy_in_9_of_10():
    recipe = RECIPES[presets.PRESETS["tiny-qwen2-python"].warm_start]
    tokenizer = presets.build_tokenizer(TOOL_TAGS)
    call_id = tokenizer.convert_tokens_to_ids(CALL)
    rng = random.Random(0)
    rows = [recipe._encode(rng, tokenizer) for _ in range(4000)]
    calls = [(ids, mask) for ids, mask in rows if call_id in ids]
    assert 0.88 < len(calls) / len(rows) < 0.92
    # The decision is the token after the prompt's "=": <call>, or an answer's first digit.
    # Where it is trained, it is a call 1 time in 4.
    after = [ids.index(tokenizer.convert_tokens_to_ids("=")) + 1 for ids, _ in rows]
    decisions = [ids[i] for (ids, mask), i in zip(rows, after) if mask[i]]
    assert 0.2 < decisions.count(call_id) / len(decisions) < 0.3
    # Every call episode trains the copy of the expression and of the result.
    for ids, mask in calls:
        start = ids.index(call_id) + 1
        prompt_len = ids.index(call_id)
        assert all(mask[start : start + prompt_len])  # the expression and </call>


def test_building_a_warm_started_preset_says_so_and_how_long(tmp_path, monkeypatch, capsys):
    def build(preset, out_dir):  # the minute of training is not what this test checks
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(presets, "build_preset", build)
    presets.preset_path("preset:tiny-qwen2-python")
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        "preset:tiny-qwen2-python: building it once: 600 steps of warm-start training, about "
        "90 s on one CPU core (no download), then it is cached"
    )
    presets.preset_path("preset:tiny-qwen2-python")  # cached: nothing to say
    assert capsys.readouterr().err == ""
