"""Warm starts: short supervised passes that give a preset a behaviour before RL begins.

A preset names its recipe (``Preset.warm_start``, a key of ``RECIPES``); the recipe trains the
freshly initialised model in place from seeded data with single-threaded math, so every build on
one machine writes the same weights.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from posttrain.tasks.data import long_sum_problem, multi_digit_problem

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The ``compact`` call syntax of the calculator and of python_sandbox: the model writes
# <call>EXPR</call>, the environment appends <result>VALUE</result>, the model writes its answer.
CALL, END_CALL, RESULT, END_RESULT = "<call>", "</call>", "<result>", "</result>"
TOOL_TAGS = (CALL, END_CALL, RESULT, END_RESULT)

Row = tuple[list[int], list[int]]  # token ids, and 1 where the loss applies


@attrs.frozen(kw_only=True)
class ToolCallRecipe:
    """Episodes of ``problem`` where a minority calls a tool with the prompt's expression.

    The rest answer at once with a wrong number near the answer, so the warm-started model calls
    the tool at about ``call_rate``, copies the tool's result when it does, and is wrong when it
    does not: what RL then has to learn is to call the tool. The call is the expression itself,
    which the calculator evaluates and python_sandbox runs as code (``echo_last_expression``).
    """

    # Bump when the recipe or the problems it draws change, so cached presets are rebuilt.
    version: str = "1"
    # How often the warm-started model calls: the share of episodes whose first token, the
    # decision to call or not, is trained to be a call.
    call_rate: float = 0.25
    # The share of episodes that call (None: call_rate). Above call_rate, more episodes teach
    # the copying while the decision is trained in only enough of them to keep call_rate.
    call_share: float | None = None
    # 1000 steps copy the result right in ~97% of calls; 700 in ~85%. ~40 s on one core.
    steps: int = 1000
    # Roughly how long the training takes on one CPU core (it runs one thread), for the line
    # that says a preset is being built.
    about_s: int = 40
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    seed: int = 0
    # rng -> {"prompt": "EXPR=", "answer": ...}: a problem of a synthetic task (tasks/data.py).
    problem: Callable[[random.Random], dict[str, str]] = multi_digit_problem

    def episode(self, rng: random.Random) -> list[tuple[str, bool]]:
        """(text, trained) segments: the prompt and the tool's result are not the model's."""
        problem = self.problem(rng)
        prompt, answer = problem["prompt"], problem["answer"]
        share = self.call_rate if self.call_share is None else self.call_share
        if rng.random() < share:
            # Trained in a fraction w of the calls, the decision's odds are share * w : 1 - share,
            # which w makes call_rate : 1 - call_rate.
            w = self.call_rate * (1 - share) / (share * (1 - self.call_rate))
            decided = w >= 1 or rng.random() < w
            return [
                (prompt, False),
                (CALL, decided),
                (f"{prompt.removesuffix('=')}{END_CALL}", True),
                (f"{RESULT}{answer}{END_RESULT}", False),
                (answer, True),
            ]
        return [(prompt, False), (_near_miss(int(answer), rng), True)]

    def train(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Teacher-forced next-token training on the episodes, loss on the model's tokens."""
        import torch

        rng = random.Random(self.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.learning_rate, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: min(1.0, (step + 1) / self.warmup_steps) * (1 - step / self.steps),
        )
        threads = torch.get_num_threads()
        # One thread: a matmul's sums then run in one order, so the weights are reproducible.
        torch.set_num_threads(1)
        model.train()
        try:
            for _ in range(self.steps):
                rows = [self._encode(rng, tokenizer) for _ in range(self.batch_size)]
                trained = sum(sum(mask) for _, mask in rows)
                optimizer.zero_grad(set_to_none=True)
                for bucket in _length_buckets(rows):
                    ids, mask = _pad(bucket, tokenizer.pad_token_id)
                    logits = model(input_ids=ids).logits[:, :-1]
                    targets, mask = ids[:, 1:], mask[:, 1:]
                    loss = torch.nn.functional.cross_entropy(
                        logits[mask], targets[mask], reduction="sum"
                    )
                    (loss / trained).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
        finally:
            model.eval()
            torch.set_num_threads(threads)

    def _encode(self, rng: random.Random, tokenizer: PreTrainedTokenizerBase) -> Row:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in self.episode(rng):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(trained)] * len(piece)
        return [*ids, tokenizer.eos_token_id], [*mask, 1]


RECIPES = {
    "calculator": ToolCallRecipe(),
    # Calls of ~18 characters to copy (the calculator's ~6), which 1000 steps at the
    # calculator's 1 call in 4 copy right in 0% of calls: 9 episodes in 10 call, teaching the
    # copy, and 600 steps copy right in ~85% (benchmarks/calculator_preset.py).
    "python_long_sum": ToolCallRecipe(
        problem=long_sum_problem, call_share=0.9, steps=600, warmup_steps=60, about_s=90
    ),
}


def _near_miss(answer: int, rng: random.Random) -> str:
    """A wrong number within about 10% of the answer (answers are >= 50, so it stays positive)."""
    offset = rng.randint(1, max(answer // 10, 10)) * rng.choice((-1, 1))
    return str(answer + offset)


def _length_buckets(rows: list[Row]) -> list[list[Row]]:
    """Rows of similar length, so short direct answers are not padded to a tool call's length."""
    buckets: dict[int, list[Row]] = {}
    for row in rows:
        buckets.setdefault(len(row[0]) // 8, []).append(row)
    return [buckets[key] for key in sorted(buckets)]


def _pad(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and loss mask; the pads follow every real token, so no attention mask."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.bool)
    return ids, mask
