"""Dynamic sampling keeps groups with a reward signal and fills the step when it must."""

from __future__ import annotations

import torch

from posttrain.protocol import RolloutSamples
from posttrain.rollout.groups import ScoredGroups, collect_groups


def scored(rewards: list[list[float]], tag: int) -> ScoredGroups:
    """One group per row of ``rewards``; prompt ``(tag, row)`` so the test can trace groups."""
    n = len(rewards[0])
    rows = len(rewards) * n
    return ScoredGroups(
        prompts=[(tag, g) for g in range(len(rewards))],
        samples=RolloutSamples(
            prompt_ids=[[tag]] * rows,
            response_ids=[[g] for g in range(rows)],
            response_logprobs=[[0.0]] * rows,
        ),
        rewards=torch.tensor([r for group in rewards for r in group]),
        reward_metrics={"reward/errors": 1.0},
    )


def test_without_dynamic_sampling_one_rollout_is_the_step():
    calls = []
    out, metrics = collect_groups(
        lambda r: calls.append(r) or scored([[1, 1], [0, 1]], r), 2, 2, False, 4
    )
    assert calls == [0] and metrics == {} and out.prompts == [(0, 0), (0, 1)]


def test_groups_without_signal_are_dropped_and_more_are_drawn():
    rounds = [
        scored([[1, 1], [0, 1], [0, 0]], 0),  # one useful group
        scored([[1, 0], [1, 1], [0, 1]], 1),  # two useful: one is needed
    ]
    out, metrics = collect_groups(lambda r: rounds[r], 3, 2, True, 4)
    assert out.prompts == [(0, 1), (1, 0), (1, 2)]
    assert out.rewards.tolist() == [0, 1, 1, 0, 0, 1]
    assert metrics == {
        "sampling/rounds": 2.0,
        "sampling/dropped_groups": 3.0,
        "sampling/filled_groups": 0.0,
        "sampling/informative_frac": 1.0,
    }
    assert out.reward_metrics["reward/errors"] == 2.0  # counts add up over rounds


def test_a_step_still_short_after_max_rounds_is_filled_with_dropped_groups():
    out, metrics = collect_groups(lambda r: scored([[1, 1], [0, 1]], r), 2, 2, True, 1)
    assert out.prompts == [(0, 1), (0, 0)]
    assert out.rewards.tolist() == [0, 1, 1, 1]
    assert metrics == {
        "sampling/rounds": 1.0,
        "sampling/dropped_groups": 1.0,
        "sampling/filled_groups": 1.0,
        "sampling/informative_frac": 0.5,
    }
