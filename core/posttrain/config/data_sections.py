"""The workflow's prompt sections: ``data`` (the training prompts) and ``evaluation`` (held-out
datasets, each in ``data``'s formats). Key names follow ROLL's where ROLL has them; every field's
comment feeds docs/config-reference.md, as in :mod:`posttrain.config.sections`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import attrs

from posttrain.config.image_rows import IMAGE_PAD, image_row_problems
from posttrain.config.ranges import at_least, between, greater_than
from posttrain.config.report import ErrorReport
from posttrain.paths import display_path


@attrs.frozen(kw_only=True)
class SyntheticData:
    # multi_digit_arithmetic: "37*48=" or "512+347="; long_sum: "12+345+67+89+10=" (5-6 terms);
    # count_shapes: a 32x32 image of red and blue squares, "how many red?" (a digit; for
    # vision-language models such as preset:tiny-qwen2-vl-count).
    task: Literal["single_digit_addition", "multi_digit_arithmetic", "long_sum", "count_shapes"] = (
        "single_digit_addition"
    )
    max_sum: int = attrs.field(default=9, validator=at_least(0))
    # default: every problem of the task once per epoch
    num_prompts: int | None = attrs.field(default=None, validator=at_least(1))
    # A fixed share of the task's problems (held_out_fraction, drawn by a seed of the task's
    # own: the same problems on every machine) is held out of "train" and is all of
    # "held_out", for an evaluation set disjoint from the training prompts; "all": every one.
    split: Literal["all", "train", "held_out"] = "all"
    held_out_fraction: float = attrs.field(
        default=0.2, validator=between(0, 1, low_open=True, high_open=True)
    )


@attrs.frozen(kw_only=True)
class DataConfig:
    """Prompts: a JSONL/Parquet file, or a synthetic task posttrain generates."""

    path: str | None = None
    synthetic: SyntheticData | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: Literal["auto", "always", "never"] = "auto"
    shuffle: bool = True
    seed: int = 42
    max_prompt_length: int = attrs.field(default=512, validator=at_least(1))


@attrs.frozen(kw_only=True)
class EvalReward:
    """A held-out dataset's own rule-based reward, in place of the train reward."""

    # As reward.function: exact_match, numeric_match, a plugin's name, or "module:function".
    function: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EvalDataset(DataConfig):
    """A held-out dataset: prompts in the formats of ``data`` (a file or a synthetic task).

    With ``shuffle``, ``evaluation.max_prompts`` takes a seeded draw of the prompts (the same at
    every evaluation); else the first ones.
    """

    # The dataset's name in the metrics: val/<name>/reward_mean, val/<name>/pass@k, ...
    name: str
    # Its own reward function; null: the train reward (reward section, reward model included).
    reward: EvalReward | None = None


@attrs.frozen(kw_only=True)
class EvaluationConfig:
    """Held-out evaluation: the rollout role scores held-out datasets between training steps.

    Each dataset logs val/<name>/reward_mean, pass@k and mean@n (see docs/evaluation.md);
    ``posttrain eval WORKFLOW --checkpoint PATH|latest`` scores a checkpoint without training.
    """

    datasets: list[EvalDataset] = attrs.field(factory=list)
    # Evaluate after every this many steps (and after the last step); 0: never during training.
    every_steps: int = attrs.field(
        default=0, validator=at_least(1, also={0: "never during training"})
    )
    # Evaluate the initial policy before the first step (a fresh run's step 0, not a resume).
    before_training: bool = False
    # Samples per prompt: pass@k is logged for k = 1, 2, 4, ... up to n, and n.
    n: int = attrs.field(default=1, validator=at_least(1))
    # Prompts per dataset; null: all of them.
    max_prompts: int | None = attrs.field(default=None, validator=at_least(1))
    # Decoding: 0 is greedy (n must be 1); above 0 samples with top_p and top_k.
    temperature: float = attrs.field(default=0.0, validator=at_least(0))
    top_p: float = attrs.field(default=1.0, validator=between(0, 1, low_open=True))
    top_k: int = attrs.field(default=-1, validator=at_least(1, also={-1: "off", 0: "off"}))
    # null: actor_infer.generating_args.max_new_tokens (its stop tokens and strings apply too).
    max_new_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    # A sample counts as solved (pass@k) when its reward is at least this.
    pass_reward: float = attrs.field(default=1.0, validator=greater_than(0))
    # Seed of sampled decoding: every evaluation draws with the same seeds.
    seed: int = 0


def check_prompt_source(data: DataConfig, base_dir: str, where: str, report: ErrorReport) -> None:
    """A data section (``data``, or a held-out dataset at YAML path ``where``) names one
    source of prompts: a file that exists, or a synthetic task."""
    if data.path and data.synthetic:
        report.error(where, f"give either {where}.path or {where}.synthetic, not both")
    elif not data.path and not data.synthetic:
        report.error(
            where,
            "no prompts",
            f"set {where}.path to a JSONL/Parquet file or "
            f"{where}.synthetic: {{task: single_digit_addition}}",
        )
    elif data.path:
        local = data.path if os.path.isabs(data.path) else os.path.join(base_dir, data.path)
        if not os.path.exists(local):
            report.error(f"{where}.path", f"file not found: {display_path(local)}")
        elif not local.endswith((".jsonl", ".json", ".parquet")):
            report.error(f"{where}.path", "unsupported file type", "use .jsonl or .parquet")
        else:
            for row, problem in image_row_problems(local, data.prompt_key, os.path.dirname(local)):
                report.error(
                    f"{where}.path",
                    f"row {row} of {display_path(local)}: {problem}",
                    "give each image as a path relative to the data file, base64 text or "
                    f"bytes, and one {IMAGE_PAD} in the prompt per image",
                )
