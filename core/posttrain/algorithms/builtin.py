"""The core's advantage estimators, policy losses and algorithm presets, declared by name.

Registered ``trylast``: a plugin declaring the same name is reported as a conflict rather than
silently replacing them. Cheap to import: the functions import torch when called.
"""

from __future__ import annotations

from posttrain.algorithms import advantages, policy_loss
from posttrain.algorithms.registry import AdvantageEstimator, AlgorithmPreset, PolicyLossTerm
from posttrain.markers import hookimpl


@hookimpl(trylast=True)
def posttrain_add_advantage_estimators() -> dict[str, AdvantageEstimator]:
    return {
        "grpo": AdvantageEstimator(
            estimate=advantages.grpo,
            min_group_size=2,
            description="group-relative: reward against its group's",
        ),
        "rloo": AdvantageEstimator(
            estimate=advantages.rloo,
            min_group_size=2,
            description="leave-one-out: reward against the mean of the others of its group",
        ),
        "reinforce_plus_plus": AdvantageEstimator(
            estimate=advantages.reinforce_plus_plus,
            description="REINFORCE++: whitened returns of token rewards with per-token KL",
        ),
        "gae": AdvantageEstimator(
            estimate=advantages.gae,
            needs_values=True,
            description="generalised advantage estimation with a critic (PPO)",
        ),
    }


@hookimpl(trylast=True)
def posttrain_add_policy_losses() -> dict[str, PolicyLossTerm]:
    return {
        "ppo": PolicyLossTerm(
            surrogate=policy_loss.ppo_surrogate,
            description="PPO clipped ratio per token, dual-clip for negative advantages",
        ),
        "gspo": PolicyLossTerm(
            surrogate=policy_loss.gspo_surrogate,
            description="GSPO: one clipped, length-normalised ratio per sequence",
        ),
    }


@hookimpl(trylast=True)
def posttrain_add_algorithms() -> dict[str, AlgorithmPreset]:
    return {
        "grpo": AlgorithmPreset(advantage_estimator="grpo"),
        "ppo": AlgorithmPreset(advantage_estimator="gae", description="needs a critic role"),
        "reinforce_plus_plus": AlgorithmPreset(advantage_estimator="reinforce_plus_plus"),
        "rloo": AlgorithmPreset(advantage_estimator="rloo"),
        "gspo": AlgorithmPreset(advantage_estimator="grpo", policy_loss="gspo"),
    }
