"""The episode runner (driver): every episode of a step, turn by turn, over the rollout engine.

Each round makes one batched ``generate`` call for all episodes still running (a request per
episode: its whole context so far, one sample, the environment's stop strings), then runs their
environments' steps side by side under ``environment.step_timeout_s``. A model turn's tokens keep
their log-probs and loss mask 1; an observation's tokens get log-prob 0 and loss mask 0. An
episode ends when its environment says done, at the turn limit (its last turn still answered),
or at the token budget of its response (model and environment tokens). An environment that
raises, hangs or answers garbage ends its episode with reward 0; the failure is counted and
logged with the episode's id (:mod:`.failures`), and the other episodes go on. Environment
instances live where ``environment.isolation`` says (:mod:`.instances`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.sections import EnvironmentConfig
from posttrain.protocol import RolloutSamples, SamplingParams
from posttrain.rewards.pool import RewardInput, RewardResults
from posttrain.rollout.environments.answers import observation_problem, step_problem
from posttrain.rollout.environments.calls import Outcome
from posttrain.rollout.environments.failures import Failure, FailureLog
from posttrain.rollout.environments.instances import make_instances
from posttrain.rollout.environments.observations import ObservationEncoder
from posttrain.rollout.environments.protocol import EnvironmentSpec, EpisodePrompt, ModelTurn
from posttrain.rollout.environments.registry import environment_factory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# generate(contexts, sampling, turn) -> one sample per context, in order.
Generate = Callable[[list[list[int]], SamplingParams, int], RolloutSamples]
ScoreAnswers = Callable[[list[RewardInput]], RewardResults]
# Episode counts of a step, logged as env/<kind> (they add up over dynamic-sampling rounds).
COUNTED = ("errors", "timeouts", "truncated", "turn_limited")


@attrs.define
class EpisodeResults:
    """Episodes as samples (``group_size`` per prompt, adjacent) with their rewards."""

    samples: RolloutSamples  # with loss_mask
    rewards: list[float]  # one per episode: the sum of its turns' (0 when its environment failed)
    turn_rewards: list[list[float]]  # per response token: each turn's on its last model token
    metrics: dict[str, float]


@attrs.define
class _Episode:
    id: str
    prompt: Any  # posttrain.tasks.data.Prompt
    context: list[int]
    prompt_length: int
    response: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    mask: list[int] = attrs.field(factory=list)
    token_rewards: list[float] = attrs.field(factory=list)
    reward: float = 0.0
    # (index of the turn's last response token, text) for reward.function to score.
    answers: list[tuple[int, str]] = attrs.field(factory=list)
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    failed: bool = False

    def append(self, ids: list[int], logprobs: list[float], trained: bool) -> None:
        self.context += ids
        self.response += ids
        self.logprobs += logprobs
        self.mask += [int(trained)] * len(ids)
        self.token_rewards += [0.0] * len(ids)

    def earn(self, reward: float, position: int) -> None:
        self.reward += reward
        if position >= 0:  # a turn without tokens has no token to hold its reward
            self.token_rewards[position] += reward


@attrs.define
class _Tally:
    """A step's episode counts (env/<kind>) and failures."""

    counts: Counter[str] = attrs.field(factory=Counter)
    failures: list[Failure] = attrs.field(factory=list)


class EpisodeRunner:
    """Runs episodes of the workflow's environment; ``config.kwargs`` is already structured.
    ``log_dir``: RUN_DIR/logs, where every failure's traceback goes (None: nowhere)."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        config: EnvironmentConfig,
        tokenizer: PreTrainedTokenizerBase,
        score: ScoreAnswers | None = None,
        log_dir: str | None = None,
    ) -> None:
        name = config.name
        assert name is not None  # episodes run only in a workflow that names its environment
        self.name = name
        factory = environment_factory(name, spec)
        self.instances = make_instances(name, spec.factory, factory, config)
        # Names the factory in a constructor's failure.
        self.constructor = (
            spec.factory if isinstance(spec.factory, str) else getattr(factory, "__qualname__", "")
        )
        self.failure_log = FailureLog(name, log_dir, config.max_failed_steps)
        self.config = config
        self.stops = spec.stops(config.kwargs)
        self.tokenizer = tokenizer
        self.encoder = ObservationEncoder(tokenizer)
        self.vocab_size = len(tokenizer)
        self.score = score

    def run(
        self,
        prompts: list[Any],
        group_size: int,
        generate: Generate,
        sampling: SamplingParams,
        where: str,
    ) -> EpisodeResults:
        """``group_size`` episodes of each prompt; ``where`` opens their ids ("step 3")."""
        episodes = [
            _Episode(
                id=f"{where} prompt {i} sample {k}",
                prompt=prompt,
                context=list(prompt.ids),
                prompt_length=len(prompt.ids),
            )
            for i, prompt in enumerate(prompts)
            for k in range(group_size)
        ]
        tally = _Tally()
        stops = tuple(dict.fromkeys((*sampling.stop, *self.stops)))
        sampling = attrs.evolve(sampling, n=1, stop=stops)
        try:
            self._start(episodes, tally)
            for turn in range(self.config.max_turns):
                active = [e for e in episodes if not e.done]
                if not active:
                    break
                self._round(active, turn, generate, sampling, tally)
        finally:
            self.instances.forget_all()
        self.failure_log.step_done(where, tally.failures, len(episodes))
        answer_metrics = self._score_answers(episodes)
        return self._results(episodes, tally.counts, answer_metrics)

    def close(self) -> None:
        """Stop the environments' worker processes (``isolation: process``)."""
        self.instances.close()

    # -- the phases of a step's episodes --------------------------------------------------------

    def _start(self, episodes: list[_Episode], tally: _Tally) -> None:
        """Build every episode's environment and reset it; an initial observation joins the
        prompt."""
        timeout = self.config.step_timeout_s
        outcomes = self.instances.create([e.id for e in episodes], timeout)
        constructor = f"the constructor ({self.constructor})"
        built = [
            e for e, o in zip(episodes, outcomes) if not self._failed(e, constructor, o, tally)
        ]
        prompts = [
            EpisodePrompt(
                episode_id=e.id, text=e.prompt.text, answer=e.prompt.answer, ids=e.prompt.ids
            )
            for e in built
        ]
        outcomes = self.instances.call(
            "reset", [(e.id, p) for e, p in zip(built, prompts)], timeout
        )
        for episode, outcome in zip(built, outcomes):
            if self._failed(episode, "reset()", outcome, tally):
                continue
            first = outcome.value
            if first is None:
                continue
            problem = observation_problem(first, self.vocab_size)
            if problem is not None:
                self._fail(episode, f"reset() answered garbage ({problem})", "errors", tally)
                continue
            ids = self.encoder.text_ids(first) if isinstance(first, str) else list(first)
            episode.context += ids
            episode.prompt_length += len(ids)

    def _round(
        self,
        active: list[_Episode],
        index: int,
        generate: Generate,
        sampling: SamplingParams,
        tally: _Tally,
    ) -> None:
        """One model turn of every running episode, then one step of their environments."""
        budget = self.config.max_total_tokens
        longest = max(budget - len(e.response) for e in active)
        sampling = attrs.evolve(sampling, max_new_tokens=min(sampling.max_new_tokens, longest))
        out = generate([list(e.context) for e in active], sampling, index)
        turns = []
        answers = zip(active, out.response_ids, out.response_logprobs, strict=True)
        for episode, ids, logprobs in answers:
            room = budget - len(episode.response)
            episode.append(list(ids[:room]), list(logprobs[:room]), trained=True)
            episode.turns += 1
            last = len(episode.response) >= budget or index + 1 == self.config.max_turns
            text = self.tokenizer.decode(ids[:room], skip_special_tokens=True)
            turns.append(ModelTurn(text=text, ids=tuple(ids[:room]), index=index, last=last))
        outcomes = self.instances.call(
            "step", [(e.id, t) for e, t in zip(active, turns)], self.config.step_timeout_s
        )
        for episode, turn, outcome in zip(active, turns, outcomes):
            self._answer(episode, turn, outcome, tally)

    def _answer(self, episode: _Episode, turn: ModelTurn, outcome: Outcome, tally: _Tally) -> None:
        """Take one environment step's answer into its episode."""
        counts = tally.counts
        if self._failed(episode, f"turn {turn.index}: step()", outcome, tally):
            return
        step = outcome.value
        problem = step_problem(step, self.vocab_size)
        if problem is not None:
            message = f"turn {turn.index}: step() answered garbage ({problem})"
            self._fail(episode, message, "errors", tally)
            return
        position = len(episode.response) - 1
        episode.earn(float(step.reward), position)
        episode.tool_calls += step.tool_calls
        if step.answer is not None:
            episode.answers.append((position, step.answer))
        if step.done:
            episode.done = True
            return
        if turn.last:
            episode.done = True
            budget_reached = len(episode.response) >= self.config.max_total_tokens
            counts["truncated" if budget_reached else "turn_limited"] += 1
            return
        ids = self.encoder.encode(step.observation, step.role, turn.ids)
        if len(episode.response) + len(ids) >= self.config.max_total_tokens:
            # No room left for a model turn after it: the budget ends the episode here.
            episode.done = True
            counts["truncated"] += 1
            return
        episode.append(ids, [0.0] * len(ids), trained=False)

    def _failed(self, episode: _Episode, call: str, outcome: Outcome, tally: _Tally) -> bool:
        if outcome.timed_out:
            message = f"{call} did not answer within {self.config.step_timeout_s:g}s"
            self._fail(episode, message, "timeouts", tally)
        elif outcome.died:
            self._fail(episode, f"{call} could not answer: {outcome.error}", "errors", tally)
        elif outcome.error is not None:
            self._fail(
                episode, f"{call} raised {outcome.error}", "errors", tally, outcome.traceback
            )
        return episode.failed

    def _fail(
        self,
        episode: _Episode,
        message: str,
        kind: str,
        tally: _Tally,
        traceback: str | None = None,
    ) -> None:
        """End ``episode`` with reward 0 (it never calls its environment again)."""
        episode.failed = episode.done = True
        tally.counts[kind] += 1
        tally.failures.append(Failure(episode.id, message, kind, traceback))

    def _score_answers(self, episodes: list[_Episode]) -> dict[str, float]:
        """reward.function's score of every answer, added where the answer was given."""
        pending = [
            (e, position, text) for e in episodes if not e.failed for position, text in e.answers
        ]
        if self.score is None:
            return {}
        results = RewardResults(scores=[])
        if pending:
            results = self.score([(text, e.prompt.answer, e.prompt.text) for e, _, text in pending])
        for (episode, position, _), score in zip(pending, results.scores):
            episode.earn(score, position)
        return {"reward/errors": float(results.errors), "reward/timeouts": float(results.timeouts)}

    def _results(
        self, episodes: list[_Episode], counts: Counter[str], answer_metrics: dict[str, float]
    ) -> EpisodeResults:
        count = len(episodes)
        samples = RolloutSamples(
            prompt_ids=[e.context[: e.prompt_length] for e in episodes],
            response_ids=[e.response for e in episodes],
            response_logprobs=[e.logprobs for e in episodes],
            loss_mask=[e.mask for e in episodes],
        )
        metrics = {
            "env/turns_mean": sum(e.turns for e in episodes) / count,
            "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / count,
            "env/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / count,
            **{f"env/{kind}": float(counts[kind]) for kind in COUNTED},
            **answer_metrics,
        }
        return EpisodeResults(
            samples=samples,
            rewards=[0.0 if e.failed else e.reward for e in episodes],
            turn_rewards=[
                [0.0] * len(e.response) if e.failed else e.token_rewards for e in episodes
            ],
            metrics=metrics,
        )
