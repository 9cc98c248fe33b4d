"""The core's advantage estimators: GRPO, RLOO, REINFORCE++ and GAE.

Tensors are laid out like :class:`posttrain.protocol.SequenceBatch` (``[rows, positions]``, the
response selected by ``response_mask``); sequence scores are one per row with the samples of a
prompt adjacent. Sequence-level estimators (GRPO, RLOO) fold the KL penalty into the score;
token-level ones (REINFORCE++, GAE) subtract it at every token, as verl and OpenRLHF do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.algorithms.registry import Advantages

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import SequenceBatch


def _kl_in_reward(algorithm: Any, batch: SequenceBatch) -> bool:
    return bool(algorithm.kl_coef) and algorithm.kl_mode == "reward" and "token_kl" in batch.tensors


def sequence_scores(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> torch.Tensor:
    """Rewards minus ``kl_coef`` times each sequence's summed KL (when the KL is a reward)."""
    if _kl_in_reward(algorithm, batch):
        return scores - algorithm.kl_coef * batch["token_kl"].sum(dim=1)
    return scores


def token_rewards(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> torch.Tensor:
    """The score on each row's last response token, minus the per-token KL penalty.

    With ``turn_rewards`` in the batch (multi-turn episodes with per-turn rewards), each turn's
    reward stays on the turn's last model token and the rest of the score (a reward model's
    part) goes on the last one, so a row's rewards still add up to its score.
    """
    import torch

    mask = batch.response_mask.float()
    rewards = torch.zeros_like(mask)
    scores = scores.float()
    if "turn_rewards" in batch.tensors:
        rewards = batch["turn_rewards"].float() * mask
        scores = scores - rewards.sum(dim=1)
    last = last_response_index(mask)
    has_response = mask.sum(dim=1) > 0
    rows = torch.arange(len(mask))[has_response]
    rewards[rows, last[has_response]] += scores[has_response]
    if _kl_in_reward(algorithm, batch):
        rewards = rewards - algorithm.kl_coef * batch["token_kl"] * mask
    return rewards


def last_response_index(mask: torch.Tensor) -> torch.Tensor:
    import torch

    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * (mask > 0)).max(dim=1).values


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / std`` over the masked entries of the whole batch; 0 elsewhere."""
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1.0)
    return (values - mean) * (var + eps).rsqrt() * mask


def group_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: ``(r - mean(group)) / (std(group) + eps)``, or without the division."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        std = (
            grouped.std(dim=1, keepdim=True, unbiased=True)
            if group_size > 1
            else grouped.new_ones(grouped.shape[0], 1)
        )
        centered = centered / (std + eps)
    return centered.reshape(-1)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each sample's reward against the mean of the *other* samples of its prompt."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError("RLOO needs algorithm.group_size >= 2 (a baseline from the others)")
    grouped = rewards.view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def grpo(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> Advantages:
    seq = sequence_scores(batch, scores, algorithm)
    adv = group_advantages(seq, algorithm.group_size, algorithm.norm_adv_by_std)
    return Advantages(advantages=adv[:, None] * batch.response_mask.float())


def rloo(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> Advantages:
    adv = leave_one_out_advantages(sequence_scores(batch, scores, algorithm), algorithm.group_size)
    return Advantages(advantages=adv[:, None] * batch.response_mask.float())


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along each row's response (0 outside it)."""
    import torch

    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


def reinforce_plus_plus(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> Advantages:
    """REINFORCE++: discounted returns of token rewards (per-token KL), whitened over the batch."""
    mask = batch.response_mask.float()
    returns = discounted_returns(token_rewards(batch, scores, algorithm), mask, algorithm.gamma)
    return Advantages(advantages=masked_whiten(returns, mask))


def gae(batch: SequenceBatch, scores: torch.Tensor, algorithm: Any) -> Advantages:
    """Generalised advantage estimation with the critic's values (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``
    along the response (``V`` after the last token is 0); the critic regresses on
    ``A_t + V_t``. Advantages are whitened over the batch when ``whiten_advantages``.
    """
    import torch

    mask = batch.response_mask.float()
    values = batch["values"].float() * mask
    rewards = token_rewards(batch, scores, algorithm)
    gamma, lam = algorithm.gamma, algorithm.lam
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0])
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(m, step, 0.0)
        # Outside the response the running terms keep their values (padding, the prompt).
        next_value = torch.where(m, values[:, t], next_value)
        running = torch.where(m, step, running)
    returns = (advantages + values) * mask
    if algorithm.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    count = mask.sum().clamp(min=1.0)
    metrics = {
        "critic/values_mean": float(values.sum() / count),
        "critic/returns_mean": float(returns.sum() / count),
    }
    return Advantages(advantages=advantages, returns=returns, metrics=metrics)


def with_advantages(
    batch: SequenceBatch, rewards: torch.Tensor, estimator: Any, algorithm: Any
) -> tuple[SequenceBatch, dict[str, float]]:
    """The advantage phase: ``batch`` with the chosen estimator's ``advantages`` (0 outside the
    response) and, for a critic, ``returns``; the estimator's metrics."""
    result = estimator.estimate(batch, rewards, algorithm)
    mask = batch.response_mask
    tensors = {"advantages": result.advantages * mask}
    if result.returns is not None:
        tensors["returns"] = result.returns
    magnitude = float((result.advantages.abs() * mask).sum() / mask.sum().clamp(min=1))
    return batch.with_tensors(**tensors), {"adv/abs_mean": magnitude, **result.metrics}
