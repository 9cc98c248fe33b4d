"""The evaluation phase: every held-out dataset of the ``evaluation:`` section sampled on the
rollout role (``n`` samples a prompt, greedy or sampled), scored by its reward, summed up as
``val/<dataset>/...`` metrics (:mod:`posttrain.evaluation.pass_at_k`).

The phase only reads the policy the rollout engine holds; the trainer runs it where that policy
is the trainer's (right after a step's weight sync, see :mod:`posttrain.trainer.run`). Its
samples use seeds of their own, so evaluating changes nothing of the training run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs

from posttrain.config.sections import RewardConfig
from posttrain.errors import UserError
from posttrain.evaluation.pass_at_k import group_metrics
from posttrain.rewards.scoring import RewardScorer, make_rule_rewards, reward_tokenizer
from posttrain.rollout.generation import generate, sampling_params
from posttrain.tasks.data import PromptSampler, load_prompts

if TYPE_CHECKING:
    import pluggy
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

    from posttrain.config.data_sections import EvalDataset
    from posttrain.config.sections import Workflow
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.placement import TimeSharing
    from posttrain.rewards.pool import RuleRewards
    from posttrain.tasks.data import Prompt


@attrs.frozen
class HeldOutSet:
    name: str
    prompts: list[Prompt]
    dataset: EvalDataset


def evaluates_after(step: int, every_steps: int, max_steps: int) -> bool:
    """After every ``every_steps``-th step and after the last one; never with 0."""
    return bool(every_steps) and (step % every_steps == 0 or step == max_steps)


def load_held_out(workflow: Workflow, tokenizer: PreTrainedTokenizerBase) -> list[HeldOutSet]:
    """The evaluation datasets' prompts (``max_prompts`` of each), read before any process
    starts so that a bad file fails fast."""
    cfg = workflow.evaluation
    sets = []
    for dataset in cfg.datasets:
        prompts = load_prompts(dataset, workflow.base_dir, tokenizer)
        if cfg.max_prompts is not None and cfg.max_prompts < len(prompts):
            draw = PromptSampler(size=len(prompts), seed=dataset.seed, shuffle=dataset.shuffle)
            prompts = [prompts[i] for i in draw.next(cfg.max_prompts)]
        sets.append(HeldOutSet(dataset.name, prompts, dataset))
    return sets


class Evaluation:
    """Runs the evaluation phase on the rollout role ``groups["actor_infer"]``.

    ``train_rules``: the train reward's rule function (the datasets without a reward of their
    own share it, and the reward model, with the training run). Each evaluation prints a line
    on ``console``.
    """

    def __init__(
        self,
        workflow: Workflow,
        sets: list[HeldOutSet],
        groups: dict[str, WorkerGroup],
        sharing: TimeSharing,
        tokenizer: PreTrainedTokenizerBase,
        train_rules: RuleRewards | None,
        hook: pluggy.HookRelay,
        console: Console,
    ) -> None:
        self.cfg = workflow.evaluation
        self.max_steps = workflow.trainer.max_steps
        self.sets = sets
        self.infer = groups["actor_infer"]
        self.sharing = sharing
        self.console = console
        model_tokenizer = reward_tokenizer(workflow) if sets else None
        gen = workflow.actor_infer.generating_args if workflow.actor_infer else None
        self.sampling = attrs.evolve(
            sampling_params(gen),
            n=self.cfg.n,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            max_new_tokens=self.cfg.max_new_tokens or sampling_params(gen).max_new_tokens,
        )
        for held_out in sets:
            if len(held_out.prompts) < self.infer.dp_size:
                raise UserError(
                    f"evaluation dataset '{held_out.name}' has {len(held_out.prompts)} "
                    f"prompt(s), fewer than actor_infer's {self.infer.dp_size} data-parallel "
                    "ranks: give it more prompts (or raise evaluation.max_prompts)"
                )
        self._own_rules: list[RuleRewards] = []  # the datasets' own reward functions
        self.scorers = []
        for held_out in sets:
            reward, rules, group = workflow.reward, train_rules, groups.get("reward")
            own = held_out.dataset.reward
            if own is not None:
                reward = RewardConfig(
                    function=own.function,
                    kwargs=own.kwargs,
                    num_workers=workflow.reward.num_workers,
                    timeout_s=workflow.reward.timeout_s,
                )
                rules, group = make_rule_rewards(reward, hook), None
                self._own_rules += [rules] if rules else []
            self.scorers.append(
                RewardScorer(
                    reward, self.cfg.n, gen, tokenizer, rules, group, sharing, model_tokenizer
                )
            )

    def due(self, step: int) -> bool:
        """Whether the phase runs after ``step``."""
        return bool(self.sets) and evaluates_after(step, self.cfg.every_steps, self.max_steps)

    def before_training(self, step: int) -> bool:
        """Whether the phase runs before the first step of a fresh run."""
        return bool(self.sets) and self.cfg.before_training and step == 0

    def run(self, step: int) -> dict[str, float]:
        """``val/<dataset>/<metric>`` of every dataset, the policy the engine holds now."""
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for index, (held_out, score) in enumerate(zip(self.sets, self.scorers)):
            self.sharing.activate("actor_infer")
            ids = [list(p.ids) for p in held_out.prompts]
            images = [p.images for p in held_out.prompts]
            seed = self.cfg.seed * 1_000_003 + index * 7919
            samples = generate(
                self.infer, ids, self.sampling, seed, images if any(images) else None
            )
            rewards, _ = score(held_out.prompts, samples)
            found = group_metrics(
                rewards.tolist(),
                [len(r) for r in samples.response_ids],
                self.cfg.n,
                self.cfg.pass_reward,
            )
            metrics.update({f"val/{held_out.name}/{k}": v for k, v in found.items()})
        self._show(step, metrics, time.perf_counter() - start)
        return metrics

    def _show(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        parts = [
            f"{held_out.name} reward {metrics[f'val/{held_out.name}/reward_mean']:.3f} "
            f"pass@{self.cfg.n} {metrics[f'val/{held_out.name}/pass@{self.cfg.n}']:.3f}"
            for held_out in self.sets
        ]
        self.console.print(
            f"eval step {step}: {'; '.join(parts)} ({seconds:.2f}s)", highlight=False, markup=False
        )

    def close(self) -> None:
        for rules in self._own_rules:
            rules.close()
        self._own_rules = []
