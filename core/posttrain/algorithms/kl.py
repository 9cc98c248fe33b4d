"""Per-token KL estimators between the policy and the reference (Schulman's k1 and k3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    import torch

    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        # k3 = r - 1 - log r with r = p_ref / p: unbiased, always >= 0.
        neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")
