"""The update phase: ``ppo_epochs`` passes over ``num_mini_batches`` mini-batches, one optimizer
step each, on a trained role (the actor or the critic).

Every mini-batch carries the totals its loss is normalised by (``global_tokens``,
``global_seqs``), so 1 rank and N ranks, fixed and dynamic micro-batches, give the same update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.protocol import SequenceBatch
from posttrain.training.metrics import accumulate, combine, is_max

if TYPE_CHECKING:
    from posttrain.config.sections import AlgorithmConfig
    from posttrain.launch.base import WorkerGroup


def update(
    group: WorkerGroup, batch: SequenceBatch, algorithm: AlgorithmConfig, measure_mismatch: bool
) -> dict[str, float]:
    """The role's training metrics of the step (means over its updates, maxima as maxima).
    ``measure_mismatch``: the first update measures the rollout-vs-trainer log-prob mismatch
    (on-policy, before it the policy is the sampler)."""
    totals: dict[str, float] = {}
    reported: dict[str, int] = {}
    for _ in range(algorithm.ppo_epochs):
        for mini in batch.split(algorithm.num_mini_batches):
            mini.meta.update(
                global_tokens=float(mini.response_mask.sum()),
                global_seqs=float(len(mini)),
                dp_size=group.dp_size,
                measure_rollout_mismatch=measure_mismatch,
            )
            measure_mismatch = False
            answers = group.call_dp("train_step", mini.split(group.dp_size))
            # grad norm and lr are the same on every rank: rank 0's; the rest are shares.
            step = combine(
                {k: v for k, v in a.items() if a is answers[0] or not _per_step(k)} for a in answers
            )
            for key in step:
                reported[key] = reported.get(key, 0) + 1
            accumulate(totals, step)
    return {k: v if is_max(k) else v / reported[k] for k, v in totals.items()}


def _per_step(key: str) -> bool:
    """Metrics every rank reports alike (not shares to add up): the routing consistency is
    reduced over the ranks already."""
    return key.endswith(("grad_norm", "lr")) or key.startswith("moe/")
