"""Group-relative advantages (GRPO): each sample's reward against its group's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``rewards`` is [num_prompts * group_size], samples of a prompt adjacent. Returns the same
    shape: ``(r - mean(group)) / (std(group) + eps)``, or without the division."""
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
