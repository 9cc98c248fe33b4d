"""Advantage estimators, policy losses and algorithm presets: the pieces plugins register.

The loop never names an algorithm: ``algorithm.name`` picks a preset, the preset (or
``algorithm.advantage_estimator`` / ``algorithm.policy_loss``) picks the pieces, and the pieces
come from the ``posttrain_add_advantage_estimators`` / ``posttrain_add_policy_losses`` /
``posttrain_add_algorithms`` hooks (the core's own are registered ``trylast`` in
:mod:`posttrain.algorithms.builtin`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.errors import UserError

if TYPE_CHECKING:
    import pluggy
    import torch

    from posttrain.config.sections import AlgorithmConfig
    from posttrain.protocol import SequenceBatch


@attrs.frozen(kw_only=True)
class Advantages:
    """An estimator's answer: per-token advantages (zero outside the response), the critic's
    regression targets when the estimator uses values, and scalar metrics."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class AdvantageEstimator:
    """``estimate(batch, scores, algorithm) -> Advantages``.

    ``batch`` holds ``response_mask``, ``values`` (when ``needs_values``), ``token_kl`` (the
    per-token KL of the old policy from the reference, when a reference role runs) and
    ``turn_rewards`` (multi-turn episodes with ``environment.reward: turn``: each turn's reward
    on its last model token, part of the row's score); ``scores`` are the sequence rewards, one
    per row, samples of one prompt adjacent (``group_size`` each). ``response_mask`` is 0 on
    tokens an environment inserted: estimators skip them as they skip the prompt.
    """

    estimate: Callable[[SequenceBatch, torch.Tensor, Any], Advantages]
    # The estimator reads the critic's values: the workflow must have a critic role.
    needs_values: bool = False
    # Estimators that compare the samples of one prompt need at least this many.
    min_group_size: int = 1
    description: str = ""


@attrs.frozen(kw_only=True)
class PolicyLossTerm:
    """``surrogate(logprobs, old_logprobs, advantages, mask, algorithm) -> (per_token, stats)``.

    ``per_token`` is the loss of every token (the core masks and aggregates it, adds the KL and
    entropy terms and the rollout-correction weights); ``stats`` maps metric names (without the
    ``actor/`` prefix) to per-token tensors whose masked means are logged.
    """

    surrogate: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    description: str = ""


@attrs.frozen(kw_only=True)
class AlgorithmPreset:
    """What ``algorithm.name`` stands for."""

    advantage_estimator: str
    policy_loss: str = "ppo"
    description: str = ""


def _merged(results: list[dict[str, Any] | None], what: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for mapping in results:
        for name, value in (mapping or {}).items():
            if name in merged and merged[name] is not value:
                raise UserError(f"two plugins declare the {what} '{name}'")
            merged[name] = value
    return merged


def advantage_estimators(hook: pluggy.HookRelay) -> dict[str, AdvantageEstimator]:
    return _merged(hook.posttrain_add_advantage_estimators(), "advantage estimator")


def policy_losses(hook: pluggy.HookRelay) -> dict[str, PolicyLossTerm]:
    return _merged(hook.posttrain_add_policy_losses(), "policy loss")


def algorithm_presets(hook: pluggy.HookRelay) -> dict[str, AlgorithmPreset]:
    return _merged(hook.posttrain_add_algorithms(), "algorithm")


def estimator_name(algorithm: AlgorithmConfig, hook: pluggy.HookRelay) -> str:
    if algorithm.advantage_estimator:
        return algorithm.advantage_estimator
    return algorithm_presets(hook)[algorithm.name].advantage_estimator


def policy_loss_name(algorithm: AlgorithmConfig, hook: pluggy.HookRelay) -> str:
    if algorithm.policy_loss:
        return algorithm.policy_loss
    return algorithm_presets(hook)[algorithm.name].policy_loss


def advantage_estimator(algorithm: AlgorithmConfig, hook: pluggy.HookRelay) -> AdvantageEstimator:
    return advantage_estimators(hook)[estimator_name(algorithm, hook)]


def policy_loss_term(algorithm: AlgorithmConfig, hook: pluggy.HookRelay) -> PolicyLossTerm:
    return policy_losses(hook)[policy_loss_name(algorithm, hook)]
