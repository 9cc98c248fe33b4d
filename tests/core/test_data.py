"""Prompt data: the synthetic task, JSONL / Parquet files, chat templates, the sampler."""

from __future__ import annotations

import json

import pytest

from posttrain.config.data_sections import DataConfig, SyntheticData
from posttrain.errors import UserError
from posttrain.tasks.data import (
    PromptSampler,
    load_prompts,
    read_records,
    synthetic_multi_digit_arithmetic,
    synthetic_single_digit_addition,
)

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.tasks.presets import build_tokenizer

    return build_tokenizer()  # no chat template


@pytest.fixture(scope="module")
def chat_tokenizer():
    from posttrain.tasks.presets import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _ids(tok, text: str) -> tuple[int, ...]:
    """One token per character (a space is the byte-level "Ġ")."""
    return tuple(tok.convert_tokens_to_ids([c.replace(" ", "Ġ") for c in text]))


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# -- synthetic ---------------------------------------------------------------------------------


def test_single_digit_addition_has_55_correct_problems():
    records = synthetic_single_digit_addition()
    assert len(records) == 55
    assert len({r["prompt"] for r in records}) == 55
    for r in records:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert int(a) + int(b) == int(r["answer"]) <= 9
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    assert len(synthetic_single_digit_addition(max_sum=18)) == 100


def test_multi_digit_arithmetic_is_fixed_and_correct(tmp_path):
    cfg = DataConfig(synthetic=SyntheticData(task="multi_digit_arithmetic"))
    records = read_records(cfg, str(tmp_path))
    assert records == synthetic_multi_digit_arithmetic()  # the same problems on every call
    assert len({r["prompt"] for r in records}) == len(records) == 1024
    kinds = {"*": 0, "+": 0}
    for r in records:
        op = "*" if "*" in r["prompt"] else "+"
        a, b = map(int, r["prompt"].removesuffix("=").split(op))
        digits = 2 if op == "*" else 3
        assert 10 ** (digits - 1) <= min(a, b) <= max(a, b) < 10**digits
        assert r["answer"] == str(a * b if op == "*" else a + b)
        kinds[op] += 1
    assert min(kinds.values()) > 400  # both kinds, about half each
    assert records[0] == {"prompt": "876+530=", "answer": "1406"}


def test_synthetic_num_prompts_cycles(tmp_path):
    cfg = DataConfig(synthetic=SyntheticData(num_prompts=60))
    records = read_records(cfg, str(tmp_path))
    assert len(records) == 60
    assert records[55:] == records[:5]


def test_synthetic_prompts_are_tokenized_without_template(tokenizer, tmp_path):
    prompts = load_prompts(DataConfig(synthetic=SyntheticData()), str(tmp_path), tokenizer)
    assert len(prompts) == 55
    first = prompts[0]
    assert (first.text, first.answer) == ("0+0=", "0")
    assert first.ids == _ids(tokenizer, "0+0=")


# -- files -------------------------------------------------------------------------------------


RECORDS = [
    {"question": "1+2=", "solution": 3, "extra": "x"},
    {"question": "4+4=", "solution": "8", "extra": "y"},
]


def _check_custom_key_prompts(prompts, tokenizer):
    assert [(p.text, p.answer) for p in prompts] == [("1+2=", "3"), ("4+4=", "8")]
    assert prompts[0].ids == _ids(tokenizer, "1+2=")


def test_jsonl_with_custom_keys(tmp_path, tokenizer):
    _write_jsonl(tmp_path / "data.jsonl", RECORDS)
    (tmp_path / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text() + "\n  \n")
    cfg = DataConfig(path="data.jsonl", prompt_key="question", answer_key="solution")
    _check_custom_key_prompts(load_prompts(cfg, str(tmp_path), tokenizer), tokenizer)


def test_parquet_with_custom_keys_and_absolute_path(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    table = pa.table(
        {
            "question": [r["question"] for r in RECORDS],
            "solution": [str(r["solution"]) for r in RECORDS],
        }
    )
    pq.write_table(table, str(path))
    cfg = DataConfig(path=str(path), prompt_key="question", answer_key="solution")
    _check_custom_key_prompts(load_prompts(cfg, "/nonexistent", tokenizer), tokenizer)


@pytest.mark.parametrize("missing", ["question", "solution"])
def test_missing_key_names_the_key(tmp_path, tokenizer, missing):
    records = [dict(RECORDS[0]), {k: v for k, v in RECORDS[1].items() if k != missing}]
    _write_jsonl(tmp_path / "data.jsonl", records)
    cfg = DataConfig(path="data.jsonl", prompt_key="question", answer_key="solution")
    with pytest.raises(UserError) as err:
        load_prompts(cfg, str(tmp_path), tokenizer)
    message = str(err.value)
    assert f"'{missing}'" in message
    assert "record 1" in message


def test_default_keys_missing_is_user_error(tmp_path, tokenizer):
    _write_jsonl(tmp_path / "data.jsonl", RECORDS)
    with pytest.raises(UserError, match="'prompt'"):
        load_prompts(DataConfig(path="data.jsonl"), str(tmp_path), tokenizer)


def test_bad_json_line_reports_line_number(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(UserError) as err:
        load_prompts(DataConfig(path="data.jsonl"), str(tmp_path), tokenizer)
    assert f"{path}:3:" in str(err.value)
    assert "invalid JSON" in str(err.value)


# -- chat template -----------------------------------------------------------------------------


def test_chat_template_applied_when_tokenizer_has_one(tmp_path, chat_tokenizer):
    _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    prompts = load_prompts(DataConfig(path="data.jsonl"), str(tmp_path), chat_tokenizer)
    bos = chat_tokenizer.bos_token_id
    assert prompts[0].ids == (bos, *_ids(chat_tokenizer, "1+2= "))
    assert all(isinstance(i, int) for i in prompts[0].ids)


def test_chat_template_never(tmp_path, chat_tokenizer):
    _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    cfg = DataConfig(path="data.jsonl", apply_chat_template="never")
    prompts = load_prompts(cfg, str(tmp_path), chat_tokenizer)
    assert prompts[0].ids == _ids(chat_tokenizer, "1+2=")


def test_auto_without_template_tokenizes_plain_text(tmp_path, tokenizer):
    _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    prompts = load_prompts(DataConfig(path="data.jsonl"), str(tmp_path), tokenizer)
    assert prompts[0].ids == _ids(tokenizer, "1+2=")


# -- length filtering --------------------------------------------------------------------------


def test_max_prompt_length_filters_long_prompts(tmp_path, tokenizer):
    records = [
        {"prompt": "1+2=", "answer": "3"},  # 4 tokens
        {"prompt": "11+22=", "answer": "33"},  # 6 tokens
        {"prompt": "1+1=", "answer": "2"},
    ]
    _write_jsonl(tmp_path / "data.jsonl", records)
    cfg = DataConfig(path="data.jsonl", max_prompt_length=4)
    prompts = load_prompts(cfg, str(tmp_path), tokenizer)
    assert [p.text for p in prompts] == ["1+2=", "1+1="]
    cfg = DataConfig(path="data.jsonl", max_prompt_length=6)
    assert len(load_prompts(cfg, str(tmp_path), tokenizer)) == 3
    cfg = DataConfig(path="data.jsonl", max_prompt_length=3)
    with pytest.raises(UserError, match="max_prompt_length=3"):
        load_prompts(cfg, str(tmp_path), tokenizer)


# -- sampler -----------------------------------------------------------------------------------


def test_sampler_is_seeded():
    a = PromptSampler(size=17, seed=3)
    b = PromptSampler(size=17, seed=3)
    c = PromptSampler(size=17, seed=4)
    seq_a, seq_b, seq_c = a.next(40), b.next(40), c.next(40)
    assert seq_a == seq_b
    assert seq_a != seq_c


def test_sampler_covers_each_index_once_per_epoch_in_new_order():
    size = 13
    sampler = PromptSampler(size=size, seed=0)
    epochs = [sampler.next(size) for _ in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(size))
    assert len({tuple(e) for e in epochs}) == 4  # a new order each epoch
    assert epochs[0] != list(range(size))  # actually shuffled
    assert sampler.state() == {"epoch": 3, "position": size}


def test_sampler_draws_across_epoch_boundaries():
    sampler = PromptSampler(size=5, seed=1)
    draws = sampler.next(3) + sampler.next(3) + sampler.next(4)
    assert sorted(draws[:5]) == list(range(5))
    assert sorted(draws[5:]) == list(range(5))


def test_sampler_without_shuffle_is_sequential():
    sampler = PromptSampler(size=4, seed=9, shuffle=False)
    assert sampler.next(10) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("cut", [0, 1, 6, 7, 13, 22])
def test_sampler_resumes_exactly(cut):
    size, total = 7, 40
    uninterrupted = PromptSampler(size=size, seed=11).next(total)
    first = PromptSampler(size=size, seed=11)
    head = first.next(cut) if cut else []
    state = json.loads(json.dumps(first.state()))  # as it goes through a checkpoint
    resumed = PromptSampler(size=size, seed=11)
    resumed.next(3)  # whatever it did before is overwritten by the loaded state
    resumed.load_state(state)
    tail = []
    while len(head) + len(tail) < total:
        tail += resumed.next(min(4, total - len(head) - len(tail)))
    assert head + tail == uninterrupted
