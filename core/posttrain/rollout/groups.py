"""Collecting a step's groups of samples, with DAPO's dynamic sampling.

A group (the ``group_size`` samples of one prompt) whose rewards are all equal has zero
group-relative advantage: it costs a training pass and teaches nothing. Dynamic sampling drops
such groups and rolls out more prompts until the step has its ``rollout_batch_size`` groups, at
most ``max_sampling_rounds`` rollouts per step; a step still short then takes dropped groups
back (and says so in ``sampling/filled_groups``) rather than fail the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.protocol import RolloutSamples

if TYPE_CHECKING:
    import torch


@attrs.define
class ScoredGroups:
    """Prompts, their samples (``group_size`` each, adjacent) and one reward per sample."""

    prompts: list[Any]
    samples: RolloutSamples
    rewards: torch.Tensor
    reward_metrics: dict[str, float] = attrs.field(factory=dict)
    # Per response token, multi-turn episodes with environment.reward: turn (each turn's
    # reward on its last model token, part of ``rewards``); None otherwise.
    turn_rewards: list[list[float]] | None = None

    def select(self, groups: list[int], group_size: int) -> ScoredGroups:
        rows = [g * group_size + k for g in groups for k in range(group_size)]
        turn_rewards = self.turn_rewards
        return ScoredGroups(
            prompts=[self.prompts[g] for g in groups],
            samples=self.samples.select(rows),
            rewards=self.rewards[rows],
            reward_metrics=self.reward_metrics,
            turn_rewards=None if turn_rewards is None else [turn_rewards[r] for r in rows],
        )

    @classmethod
    def concat(cls, parts: list[ScoredGroups]) -> ScoredGroups:
        import torch

        # Every round of a step runs the same environment: all have turn rewards, or none.
        turn_rewards: list[list[float]] | None = None
        if parts[0].turn_rewards is not None:
            turn_rewards = []
            for part in parts:
                assert part.turn_rewards is not None
                turn_rewards += part.turn_rewards
        return cls(
            prompts=[p for part in parts for p in part.prompts],
            samples=RolloutSamples.concat(part.samples for part in parts),
            rewards=torch.cat([part.rewards for part in parts]),
            reward_metrics=_mean_metrics([part.reward_metrics for part in parts]),
            turn_rewards=turn_rewards,
        )


def _mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Counts (``reward/errors``, ``env/truncated``, ...) add up over rounds; the rest
    average."""
    out: dict[str, float] = {}
    for key in {k for part in parts for k in part}:
        values = [part[key] for part in parts if key in part]
        counted = key.endswith(("errors", "timeouts", "truncated", "turn_limited"))
        out[key] = sum(values) if counted else sum(values) / len(values)
    return out


def informative_groups(rewards: torch.Tensor, group_size: int) -> list[bool]:
    grouped = rewards.view(-1, group_size)
    return [bool(row.max() > row.min()) for row in grouped]


def collect_groups(
    roll_out: Callable[[int], ScoredGroups],
    rollout_batch_size: int,
    group_size: int,
    dynamic: bool,
    max_rounds: int,
) -> tuple[ScoredGroups, dict[str, float]]:
    """``roll_out(round)`` draws ``rollout_batch_size`` prompts, samples and scores them."""
    first = roll_out(0)
    if not dynamic:
        return first, {}
    kept: list[ScoredGroups] = []
    dropped: list[ScoredGroups] = []
    have, dropped_count, rounds = 0, 0, 0
    batch = first
    while True:
        rounds += 1
        useful = informative_groups(batch.rewards, group_size)
        good = [g for g, ok in enumerate(useful) if ok]
        bad = [g for g, ok in enumerate(useful) if not ok]
        take = good[: rollout_batch_size - have]
        kept.append(batch.select(take, group_size))
        dropped.append(batch.select(bad, group_size))
        have += len(take)
        dropped_count += len(bad)
        if have >= rollout_batch_size or rounds >= max_rounds:
            break
        batch = roll_out(rounds)
    filled = rollout_batch_size - have
    if filled:
        spare = ScoredGroups.concat(dropped)
        kept.append(spare.select(list(range(filled)), group_size))
    out = ScoredGroups.concat(kept)
    useful = informative_groups(out.rewards, group_size)
    metrics = {
        "sampling/rounds": float(rounds),
        "sampling/dropped_groups": float(dropped_count),
        "sampling/filled_groups": float(filled),
        "sampling/informative_frac": sum(useful) / len(useful),
    }
    return out, metrics
