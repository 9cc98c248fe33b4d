"""The critic's loss: clipped value regression on the estimator's returns (PPO's value loss).

Called by the critic's backend as ``ValueLoss(algorithm)(values, None, micro_batch)`` with the
values of the micro-batch (aligned as ``posttrain_compute_values``); the micro-batch holds the
values the critic gave before the update (``values``) and the targets (``returns``). Like the
policy loss, the result is this micro-batch's share of the global token mean, times the DP size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.algorithms.policy_loss import aggregate

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import SequenceBatch


class ValueLoss:
    def __init__(self, algorithm: Any):
        self.algorithm = algorithm

    def __call__(
        self, values: torch.Tensor, _entropy: torch.Tensor | None, batch: SequenceBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        import torch

        width = values.shape[1]
        mask = batch.response_mask[:, :width].to(values.dtype)
        old = batch["values"][:, :width].to(values.dtype)
        returns = batch["returns"][:, :width].to(values.dtype)
        unclipped = (values - returns) ** 2
        clip = self.algorithm.cliprange_value
        if clip is None:
            per_token = 0.5 * unclipped
            clip_frac = torch.zeros_like(unclipped)
        else:
            # The new value may move at most ``cliprange_value`` from the one the advantages
            # were computed with; the loss is the worse of the clipped and unclipped errors.
            clipped = (old + torch.clamp(values - old, -clip, clip) - returns) ** 2
            per_token = 0.5 * torch.maximum(unclipped, clipped)
            clip_frac = (clipped > unclipped).to(values.dtype)
        meta = batch.meta
        loss = aggregate(per_token, mask, "token-mean", meta) * int(meta.get("dp_size", 1))

        def share(tensor: torch.Tensor) -> float:
            return float(aggregate(tensor.detach(), mask, "token-mean", meta))

        return loss, {
            "critic/vf_loss": share(per_token),
            "critic/vf_clip_frac": share(clip_frac),
            "critic/values_pred_mean": share(values),
        }
