"""The reward phase: each sample's reward, ``function_weight`` x the rule-based function (or,
with an environment, its episodes' rewards) + ``model_weight`` x the reward model's score."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from posttrain.backends.models import load_tokenizer, resolve_model_path
from posttrain.protocol import RolloutSamples, stop_string_start
from posttrain.rewards.functions import resolve_reward_function, reward_function_names
from posttrain.rewards.model import reward_model_batch
from posttrain.rewards.pool import RuleRewards

if TYPE_CHECKING:
    import pluggy
    from transformers import PreTrainedTokenizerBase

    from posttrain.config.sections import GeneratingArgs, ModelArgs, RewardConfig, Workflow
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.placement import TimeSharing


def make_rule_rewards(reward: RewardConfig, hook: pluggy.HookRelay) -> RuleRewards | None:
    """The rule-based reward function of ``reward``, or None when the workflow has none."""
    if not reward.function:
        return None
    fn = resolve_reward_function(reward.function, hook)
    target = reward_function_names(hook).get(reward.function, reward.function)
    return RuleRewards(fn, target, reward.kwargs, reward.num_workers, reward.timeout_s)


def reward_tokenizer(workflow: Workflow) -> PreTrainedTokenizerBase | None:
    """The reward model's tokenizer when it is not the policy's (then responses are decoded and
    encoded again for it), else None."""
    reward = workflow.reward
    if reward.role() is None:
        return None

    def tokenizer_path(args: ModelArgs) -> str:
        return resolve_model_path(
            args.tokenizer_name_or_path or args.model_name_or_path, workflow.base_dir
        )

    policy = workflow.roles()["actor_infer"]
    if tokenizer_path(reward.model_args) == tokenizer_path(policy.model_args):
        return None
    return load_tokenizer(reward.model_args, workflow.base_dir)


def response_texts(
    samples: RolloutSamples,
    tokenizer: PreTrainedTokenizerBase,
    generating_args: GeneratingArgs | None,
) -> list[str]:
    """Each response as the reward function sees it: decoded, cut at its stop token or stop
    string."""
    gen = generating_args
    stop = set(gen.stop_token_ids if gen else ()) | {tokenizer.eos_token_id}
    stop_strings = tuple(gen.stop_strings) if gen else ()
    texts = []
    for response in samples.response_ids:
        ids = response[:-1] if response and response[-1] in stop else response
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = stop_string_start(text, stop_strings)
        texts.append(text if cut is None else text[:cut])
    return texts


class RewardScorer:
    """Scores rollouts: ``rule_rewards`` (None without a function), the reward model's
    ``reward_group`` (None without one, activated through ``sharing`` before it scores) and
    ``tokenizer`` (the policy's; ``model_tokenizer`` when the reward model has its own)."""

    def __init__(
        self,
        reward: RewardConfig,
        group_size: int,
        generating_args: GeneratingArgs | None,
        tokenizer: PreTrainedTokenizerBase,
        rule_rewards: RuleRewards | None,
        reward_group: WorkerGroup | None,
        sharing: TimeSharing,
        model_tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.reward = reward
        self.group_size = group_size
        self.generating_args = generating_args
        self.tokenizer = tokenizer
        self.rule_rewards = rule_rewards
        self.reward_group = reward_group
        self.sharing = sharing
        self.model_tokenizer = model_tokenizer

    def __call__(
        self, picked: list[Any], samples: RolloutSamples, env_rewards: list[float] | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``(rewards [samples], metrics)`` of the samples of prompts ``picked`` (``n`` a
        prompt, in order); ``env_rewards``: an environment's episode rewards, which take the
        rule function's place."""
        metrics: dict[str, float] = {}
        total = torch.zeros(len(samples), dtype=torch.float32)
        scores = None
        if env_rewards is not None:
            scores = torch.tensor(env_rewards, dtype=torch.float32)
        elif self.rule_rewards is not None:
            n = self.group_size
            texts = response_texts(samples, self.tokenizer, self.generating_args)
            items = [
                (text, picked[i // n].answer, picked[i // n].text) for i, text in enumerate(texts)
            ]
            results = self.rule_rewards(items)
            scores = torch.tensor(results.scores, dtype=torch.float32)
            metrics["reward/errors"] = float(results.errors)
            metrics["reward/timeouts"] = float(results.timeouts)
        if scores is not None:
            total += self.reward.function_weight * scores
            if self.reward_group is not None:
                metrics["reward/function_mean"] = float(scores.mean())
        if self.reward_group is not None:
            self.sharing.activate("reward")
            scores = self._model_scores(self.reward_group, samples)
            total += self.reward.model_weight * scores
            metrics["reward/model_mean"] = float(scores.mean())
        return total, metrics

    def _model_scores(self, group: WorkerGroup, samples: RolloutSamples) -> torch.Tensor:
        batch = reward_model_batch(samples, self.tokenizer, self.model_tokenizer)
        shares = group.call_dp("compute_scores", batch.split(group.dp_size))
        return torch.cat([s.float().reshape(-1) for s in shares])
