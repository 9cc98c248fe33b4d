"""Rollout correction: truncated importance sampling (TIS) between rollout and trainer.

The samples come from the rollout engine's distribution (another engine, another dtype), while
the ratio of the policy loss is taken against the trainer's old policy. Weighting each token's
loss by ``min(p_old(token) / p_rollout(token), cap)`` corrects the mismatch with a bounded
variance (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights (0 outside the response) and their statistics before truncation."""
    import torch

    log_ratio = torch.clamp(old_logprobs - rollout_logprobs, min=-20.0, max=20.0)
    raw = torch.exp(log_ratio) * mask
    weights = torch.clamp(raw, max=cap) * mask
    count = mask.sum().clamp(min=1.0)
    metrics = {
        "rollout/tis_weight_mean": float(raw.sum() / count),
        "rollout/tis_weight_max": float(raw.max()) if raw.numel() else 0.0,
        "rollout/tis_capped_frac": float(((raw > cap) & (mask > 0)).sum() / count),
    }
    return weights, metrics
