"""The advantage estimator ``sign``: +1 for a reward above its group's mean, -1 below, 0 at it.

A toy, to show the seam: a workflow picks it with ``algorithm.advantage_estimator: sign``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain import Advantages

if TYPE_CHECKING:  # types only: the entry-point module imports this one, and stays cheap
    import torch

    from posttrain import AlgorithmConfig, SequenceBatch


def sign_advantages(
    batch: SequenceBatch, scores: torch.Tensor, algorithm: AlgorithmConfig
) -> Advantages:
    grouped = scores.view(-1, algorithm.group_size)
    sign = (grouped - grouped.mean(dim=1, keepdim=True)).sign().reshape(-1)
    return Advantages(advantages=sign[:, None] * batch.response_mask)
