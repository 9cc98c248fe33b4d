"""The log-prob and value phases: the old policy's and the reference's log-probs of every
sampled token (and the KL between them), and the critic's values.

Old-policy log-probs come from the rollout engine when the update is on-policy
(``algorithm.old_logprobs_source()``), else from a trainer forward pass; then the rollout's
mismatch with the trainer is measured and, with ``tis_cap``, corrected by truncated importance
weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain.algorithms.correction import tis_weights
from posttrain.algorithms.kl import kl_penalty
from posttrain.protocol import SequenceBatch, concat_tensor_rows

if TYPE_CHECKING:
    from posttrain.config.sections import AlgorithmConfig
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.placement import TimeSharing


def per_token(group: WorkerGroup, method: str, batch: SequenceBatch) -> torch.Tensor:
    """``method`` (``compute_logprobs``, ``compute_values``) of every row of ``batch``, split
    over the group's data-parallel ranks."""
    return concat_tensor_rows(group.call_dp(method, batch.split(group.dp_size)))


def rollout_mismatch(
    rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's."""
    diff = (rollout - trainer).abs() * mask
    return {
        "rollout/logprob_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)),
        "rollout/logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
    }


def old_and_reference_logprobs(
    batch: SequenceBatch,
    algorithm: AlgorithmConfig,
    groups: dict[str, WorkerGroup],
    sharing: TimeSharing,
) -> tuple[SequenceBatch, dict[str, float]]:
    """``batch`` with ``old_logprobs`` (and ``tis_weights``; with a ``reference`` group,
    ``ref_logprobs`` and ``token_kl``), and the phase's metrics."""
    mask = batch.response_mask
    metrics: dict[str, float] = {}
    if algorithm.old_logprobs_source() == "rollout":
        # On-policy: the policy that sampled is the one being updated, so the rollout's
        # log-probs are the old policy's (the mismatch is measured in the first update).
        old = batch["rollout_logprobs"] * mask
    else:
        sharing.activate("actor_train")
        old = per_token(groups["actor_train"], "compute_logprobs", batch) * mask
        metrics.update(rollout_mismatch(batch["rollout_logprobs"], old, mask))
        if algorithm.tis_cap is not None:
            weights, tis_metrics = tis_weights(
                old, batch["rollout_logprobs"], mask.float(), algorithm.tis_cap
            )
            batch = batch.with_tensors(tis_weights=weights)
            metrics.update(tis_metrics)
    batch = batch.with_tensors(old_logprobs=old)
    if "reference" in groups:
        sharing.activate("reference")
        ref = per_token(groups["reference"], "compute_logprobs", batch)
        batch = batch.with_tensors(ref_logprobs=ref * mask)
        kl = kl_penalty(old, ref, algorithm.kl_estimator) * mask
        metrics["actor/kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        batch = batch.with_tensors(token_kl=kl)
    return batch, metrics


def critic_values(batch: SequenceBatch, critic: WorkerGroup, sharing: TimeSharing) -> SequenceBatch:
    """``batch`` with the critic's ``values`` of every response token."""
    sharing.activate("critic")
    values = per_token(critic, "compute_values", batch)
    return batch.with_tensors(values=values * batch.response_mask)
