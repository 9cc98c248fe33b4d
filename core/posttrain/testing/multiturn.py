"""The multi-turn check of a rollout engine: examples/calculator_tool.yaml run with the engine as
actor_infer on 2 ranks for a few steps, and what its metrics must show.

* Tool calls happen: the warm-started calculator preset calls the tool in about 1 answer of 4.
* Some step's second round holds fewer episodes than the rollout ranks, so a rank gets an empty
  request (``rollout_batch_size`` must cover the ranks, but later turns only go on for the
  episodes that called the tool). With 4 episodes a step, a step has one such round with
  odds near 0.4, so 10 steps (each well under a second: the engines' start-up is the cost) miss
  with odds under 1%; per-request seeds make a given machine's outcome repeatable.
* The first update's ``rollout/logprob_diff_max`` is within the engine's tolerance on every
  step. A tool token enters an episode with log-prob 0 and loss mask 0, and the trainer gives it
  a log-prob far from 0 (-3 to -16 for `<result>1776</result>` after a call, measured on the
  head-32 preset), so this holds only if the engine scores model turns of continued
  contexts as the trainer does *and* tool tokens are outside the mask.

Used by tests/vllm/test_vllm_multiturn.py and tests/sglang/test_sglang_multiturn.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

STEPS = 10
PROMPTS_PER_STEP = 2
GROUP_SIZE = 2
EPISODES_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE


def engine_multiturn_overrides(
    run_dir: Path, preset: str, strategy: str, strategy_config: str
) -> list[str]:
    """``--set`` items that put the calculator example on ``strategy`` for a short run."""
    return [
        f"model_args.model_name_or_path={preset}",
        f"actor_infer.strategy_args.strategy_name={strategy}",
        f"actor_infer.strategy_args.strategy_config={strategy_config}",
        f"algorithm.rollout_batch_size={PROMPTS_PER_STEP}",
        f"algorithm.group_size={GROUP_SIZE}",
        f"actor_train.training_args.per_device_train_batch_size={EPISODES_PER_STEP}",
        f"trainer.max_steps={STEPS}",
        "trainer.save_steps=0",
        "trainer.resume=never",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={run_dir}",
    ]


@attrs.frozen
class MultiturnRun:
    metrics: list[dict]
    ranks: int

    def second_round(self, step: dict) -> int:
        """Episodes of ``step`` that took a second turn (the example allows 2)."""
        return round((step["env/turns_mean"] - 1) * EPISODES_PER_STEP)

    def summary(self) -> str:
        return ", ".join(
            f"step {m['step']}: {self.second_round(m)} second turns, "
            f"{m['env/tool_calls_mean'] * EPISODES_PER_STEP:.0f} tool calls, "
            f"logprob diff max {m['rollout/logprob_diff_max']:.2e}"
            for m in self.metrics
        )

    def check(self, logprob_tolerance: float) -> None:
        steps = [m["step"] for m in self.metrics]
        assert steps == list(range(1, STEPS + 1)), steps
        assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in self.metrics)
        assert sum(m["env/tool_calls_mean"] for m in self.metrics) > 0, "no tool call"
        rounds = [self.second_round(m) for m in self.metrics]
        assert any(0 < r < self.ranks for r in rounds), (
            f"no second round with fewer episodes than the {self.ranks} ranks: {rounds}"
        )
        worst = max(m["rollout/logprob_diff_max"] for m in self.metrics)
        assert worst <= logprob_tolerance, f"rollout vs trainer log-probs: {worst:.2e}"


def read_multiturn_run(run_dir: Path, ranks: int) -> MultiturnRun:
    with open(run_dir / "metrics.jsonl") as f:
        return MultiturnRun([json.loads(line) for line in f], ranks)
