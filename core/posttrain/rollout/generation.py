"""The rollout phase: draw a step's prompts, sample ``group_size`` responses each on the rollout
role (single turns, or multi-turn episodes in the workflow's environment), and score them.

Generation is split over the rollout role's data-parallel ranks in contiguous shares; every
rollout has a seed of its own (from the run's seed, the step and its dynamic-sampling round), so
a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from posttrain.errors import UserError
from posttrain.protocol import GenerationRequest, ImageInputs, RolloutSamples, SamplingParams
from posttrain.rollout.environments.registry import environment_specs
from posttrain.rollout.environments.runner import EpisodeRunner
from posttrain.rollout.groups import ScoredGroups
from posttrain.rollout.partial import (
    EngineTurn,
    end_token_ids,
    generate_in_segments,
    segment_tokens,
)

if TYPE_CHECKING:
    import pluggy
    from transformers import PreTrainedTokenizerBase

    from posttrain.config.sections import GeneratingArgs, Workflow
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.placement import TimeSharing
    from posttrain.rewards.scoring import RewardScorer
    from posttrain.tasks.data import Prompt, PromptSampler
    from posttrain.trainer.phase_timer import PhaseTimer


def sampling_params(generating_args: GeneratingArgs | None) -> SamplingParams:
    """The workflow's sampling settings, for one sample per prompt."""
    gen = generating_args
    return SamplingParams(
        n=1,
        temperature=gen.temperature if gen else 1.0,
        top_p=gen.top_p if gen else 1.0,
        top_k=gen.top_k if gen else -1,
        max_new_tokens=gen.max_new_tokens if gen else 32,
        stop_token_ids=tuple(gen.stop_token_ids) if gen else (),
        stop=tuple(gen.stop_strings) if gen else (),
        ignore_eos=gen.ignore_eos if gen else False,
    )


def rollout_seed(run_seed: int, index: int, round_: int) -> int:
    """The seed of step ``index``'s rollout (``round_``: its dynamic-sampling round)."""
    return run_seed * 1_000_003 + index * 1009 + round_ * 131


def generate(
    infer: WorkerGroup,
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    seed: int,
    images: list[ImageInputs | None] | None = None,
) -> RolloutSamples:
    """``sampling.n`` samples of every prompt on the rollout role's data-parallel ranks;
    ``images``: per prompt, its images (vision-language models)."""
    dp = infer.dp_size
    # Contiguous shares, the first len % dp one prompt longer (ROLL's 64 prompts over 12
    # engines); concatenated in order, sample i still belongs to prompt i // sampling.n.
    per, extra = divmod(len(prompt_ids), dp)
    bounds = [i * per + min(i, extra) for i in range(dp + 1)]
    requests = [
        GenerationRequest(
            prompt_ids=prompt_ids[bounds[i] : bounds[i + 1]],
            sampling=sampling,
            seed=seed + i,
            images=None if images is None else images[bounds[i] : bounds[i + 1]],
        )
        for i in range(dp)
    ]
    return RolloutSamples.concat(infer.call_dp("generate", requests))


class Rollout:
    """Rolls out and scores the prompts of one step (or one of its dynamic-sampling rounds).

    ``prompts`` and ``sampler``: the task's prompts and the draw over them; ``score``: the
    reward phase; ``sharing``: activates the rollout role on shared devices; ``log_dir``:
    RUN_DIR/logs, where environment failures are logged.
    """

    def __init__(
        self,
        workflow: Workflow,
        infer: WorkerGroup,
        sharing: TimeSharing,
        prompts: list[Prompt],
        sampler: PromptSampler,
        score: RewardScorer,
        tokenizer: PreTrainedTokenizerBase,
        hook: pluggy.HookRelay,
        log_dir: str | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.algorithm = workflow.algorithm
        self.environment = workflow.environment
        self.generating_args = workflow.roles()["actor_infer"].generating_args
        self.seed = workflow.trainer.seed
        self.function_weight = workflow.reward.function_weight
        self.infer = infer
        self.sharing = sharing
        self.prompts = prompts
        self.sampler = sampler
        self.score = score
        self.tokenizer = tokenizer
        self.hook = hook

    def __call__(
        self, index: int, round_: int, timer: PhaseTimer, engine_turn: EngineTurn | None = None
    ) -> ScoredGroups:
        """Draw the prompts of step ``index`` (``round_``: its dynamic-sampling round), roll
        them out and score them. ``engine_turn``: partial rollouts, the engine taken per
        segment (asynchronous rollout with ``algorithm.partial_rollout``)."""
        picked = [self.prompts[i] for i in self.sampler.next(self.algorithm.rollout_batch_size)]
        seed = rollout_seed(self.seed, index, round_)
        if (self.environment.name or engine_turn is not None) and any(p.images for p in picked):
            raise UserError(
                "prompts with images are rolled out in one piece without an environment for "
                "now: unset environment.name and algorithm.partial_rollout"
            )
        if self.environment.name:
            label = f"step {index}" + (f" round {round_}" if round_ else "")
            return self._episodes(picked, seed, label, timer)
        with timer.phase("rollout"):
            self.sharing.activate("actor_infer")
            sampling = attrs.evolve(
                sampling_params(self.generating_args), n=self.algorithm.group_size
            )
            prompt_ids = [list(p.ids) for p in picked]
            images = [p.images for p in picked] if any(p.images for p in picked) else None
            if engine_turn is None:
                samples = generate(self.infer, prompt_ids, sampling, seed, images)
            else:
                samples = generate_in_segments(
                    functools.partial(generate, self.infer),
                    prompt_ids,
                    sampling,
                    seed,
                    segment_tokens(self.algorithm, self.generating_args),
                    end_token_ids(sampling, self.tokenizer.eos_token_id),
                    engine_turn,
                )
        with timer.phase("reward"):
            rewards, metrics = self.score(picked, samples)
        return ScoredGroups(
            prompts=picked, samples=samples, rewards=rewards, reward_metrics=metrics
        )

    def _episodes(
        self, picked: list[Prompt], seed: int, label: str, timer: PhaseTimer
    ) -> ScoredGroups:
        """Multi-turn episodes in the workflow's environment (``environment.name``): their
        rewards take the place of the rule function's score."""
        with timer.phase("rollout"):
            self.sharing.activate("actor_infer")
            episodes = self._episode_runner.run(
                picked,
                self.algorithm.group_size,
                # Each turn samples with a seed of its own, as rounds do.
                self._turn_sampler(seed),
                sampling_params(self.generating_args),
                label,
            )
        with timer.phase("reward"):
            rewards, metrics = self.score(picked, episodes.samples, episodes.rewards)
        turn_rewards = None
        if self.environment.reward == "turn":
            weight = self.function_weight
            turn_rewards = [[weight * r for r in row] for row in episodes.turn_rewards]
        return ScoredGroups(
            prompts=picked,
            samples=episodes.samples,
            rewards=rewards,
            reward_metrics={**episodes.metrics, **metrics},
            turn_rewards=turn_rewards,
        )

    def _turn_sampler(self, seed: int) -> Callable[..., RolloutSamples]:
        def sample(
            contexts: list[list[int]], sampling: SamplingParams, turn: int
        ) -> RolloutSamples:
            return generate(self.infer, contexts, sampling, seed + turn * 7919)

        return sample

    @functools.cached_property
    def _episode_runner(self) -> EpisodeRunner:
        """The environment's episode runner, made for the first step (reward.function scores
        the answers environments hand over)."""
        name = self.environment.name
        assert name is not None  # made only for a workflow that names its environment
        spec = environment_specs(self.hook)[name]
        return EpisodeRunner(
            spec, self.environment, self.tokenizer, self.score.rule_rewards, self.log_dir
        )

    def close(self) -> None:
        """Stop what the environment's episodes started (worker processes)."""
        runner = self.__dict__.pop("_episode_runner", None)  # made at the first step, if ever
        if runner is not None:
            runner.close()
