"""Prompt data: JSONL / Parquet files or a synthetic task, tokenized, with a resumable sampler."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.data_sections import DataConfig
from posttrain.config.image_rows import decode_image, image_row_problem
from posttrain.errors import UserError
from posttrain.tasks.vision import count_shapes, load_image_processor, process_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.protocol import ImageInputs


@attrs.frozen
class Prompt:
    text: str
    answer: str
    ids: tuple[int, ...]
    # A vision-language prompt's images, processed once (posttrain.tasks.vision).
    images: ImageInputs | None = attrs.field(default=None, eq=False)


def synthetic_single_digit_addition(max_sum: int = 9) -> list[dict[str, str]]:
    """Every ``a+b=`` with digits a, b and a + b <= max_sum; the answer is the sum."""
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
        if a + b <= max_sum
    ]


def multi_digit_problem(rng: random.Random) -> dict[str, str]:
    """A product of two 2-digit numbers or a sum of two 3-digit numbers, with equal odds.

    Both need carries across several digits, which a 1-2 layer model cannot compute by itself
    but can copy from a calculator's result; answers have 3 or 4 digits.
    """
    if rng.random() < 0.5:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def long_sum_problem(rng: random.Random) -> dict[str, str]:
    """A sum of 5 or 6 numbers of 2 or 3 digits (``12+345+67+89+10=``): too many carries for a
    tiny model to add up, short enough to copy into a ``python`` call; answers have 3-4 digits."""
    count = rng.choice((5, 6))
    terms = [
        rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999) for _ in range(count)
    ]
    return {"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))}


def distinct_problems(
    problem: Callable[[random.Random], dict[str, str]], count: int = 1024, seed: int = 0
) -> list[dict[str, str]]:
    """``count`` distinct problems drawn by ``problem``, the same ones on every machine."""
    rng = random.Random(seed)
    records: dict[str, dict[str, str]] = {}
    while len(records) < count:
        record = problem(rng)
        records.setdefault(record["prompt"], record)
    return list(records.values())


def synthetic_multi_digit_arithmetic(count: int = 1024, seed: int = 0) -> list[dict[str, str]]:
    """``count`` distinct problems of ``multi_digit_problem``, the same ones on every machine."""
    return distinct_problems(multi_digit_problem, count, seed)


# task name -> records, given the data.synthetic section
SYNTHETIC_TASKS = {
    "single_digit_addition": lambda synthetic: synthetic_single_digit_addition(synthetic.max_sum),
    "multi_digit_arithmetic": lambda synthetic: synthetic_multi_digit_arithmetic(),
    "long_sum": lambda synthetic: distinct_problems(long_sum_problem),
    # Images drawn with PIL: how many red squares (posttrain.tasks.vision.count_shapes).
    "count_shapes": lambda synthetic: count_shapes(),
}


# The seed of the held-out draw of synthetic tasks: one for every run, so that a held-out split
# never changes with the run's seed.
HELD_OUT_SEED = 20_211_107


def split_records(records: list[dict], split: str, fraction: float) -> list[dict]:
    """``records`` (``split`` "all"), or the held-out share of them or the rest, in order."""
    if split == "all":
        return records
    count = min(max(1, round(fraction * len(records))), len(records) - 1)
    order = list(range(len(records)))
    random.Random(HELD_OUT_SEED).shuffle(order)
    held_out = set(order[:count])
    return [r for i, r in enumerate(records) if (i in held_out) == (split == "held_out")]


def read_records(cfg: DataConfig, base_dir: str) -> list[dict]:
    if cfg.synthetic is not None:
        synthetic = cfg.synthetic
        records = SYNTHETIC_TASKS[synthetic.task](synthetic)
        records = split_records(records, synthetic.split, synthetic.held_out_fraction)
        return (
            records
            if cfg.synthetic.num_prompts is None
            else [records[i % len(records)] for i in range(cfg.synthetic.num_prompts)]
        )
    # check_data_source (config) has required data.path where there is no synthetic task.
    assert cfg.path is not None
    path = cfg.path if os.path.isabs(cfg.path) else os.path.join(base_dir, cfg.path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
    return records


def data_dir(cfg: DataConfig, base_dir: str) -> str:
    """The folder image paths of ``cfg``'s rows are relative to: the data file's."""
    if cfg.path is None:
        return base_dir
    path = cfg.path if os.path.isabs(cfg.path) else os.path.join(base_dir, cfg.path)
    return os.path.dirname(path)


def load_prompts(
    cfg: DataConfig,
    base_dir: str,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None = None,
) -> list[Prompt]:
    """The dataset's prompts, rendered through the tokenizer's chat template when it applies;
    ``tools`` (the environment's tool schemas) go to the template's tool list."""
    records = read_records(cfg, base_dir)
    prompt_key, answer_key = (
        ("prompt", "answer") if cfg.synthetic else (cfg.prompt_key, cfg.answer_key)
    )
    use_template = cfg.apply_chat_template == "always" or (
        cfg.apply_chat_template == "auto" and getattr(tokenizer, "chat_template", None)
    )
    base = data_dir(cfg, base_dir)
    image_processor = (
        load_image_processor(tokenizer) if any(r.get("images") for r in records) else None
    )
    prompts = []
    for index, record in enumerate(records):
        for key in (prompt_key, answer_key):
            if key not in record:
                raise UserError(
                    f"data record {index} has no key '{key}' (keys: "
                    f"{', '.join(map(str, record))}); set data.prompt_key / "
                    "data.answer_key"
                )
        text = str(record[prompt_key])
        images = None
        if record.get("images"):
            # check_image_rows found these rows sound before anything started; a file that
            # changed since is caught here.
            problem = image_row_problem(record, prompt_key, base)
            if problem is not None:
                raise UserError(f"data record {index}: {problem}")
            assert image_processor is not None  # made above for data with images
            pictures = [decode_image(value, base) for value in record["images"]]
            # The template wraps the prompt, its image placeholders included, as the model's
            # chat format wants; the processor then expands each placeholder to its image.
            rendered = (
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=False,
                )
                if use_template
                else text
            )
            ids, images = process_prompt(
                str(rendered),
                pictures,
                tokenizer,
                image_processor,
                add_special_tokens=not use_template,
            )
        elif use_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
            )
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a UserDict)
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > cfg.max_prompt_length:
            continue
        prompts.append(
            Prompt(text=text, answer=str(record[answer_key]), ids=tuple(ids), images=images)
        )
    if not prompts:
        raise UserError(
            "no usable prompt in the data (all longer than "
            f"data.max_prompt_length={cfg.max_prompt_length}?)"
        )
    return prompts


@attrs.define
class PromptSampler:
    """Seeded shuffling per epoch; ``state()`` / ``load_state()`` make it resumable."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
