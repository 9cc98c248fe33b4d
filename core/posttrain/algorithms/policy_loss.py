"""The clipped policy-gradient loss shared by every training backend.

Backends call ``PolicyLoss(algorithm)(logprobs, entropy, micro_batch)`` for each micro-batch and
call ``backward()`` on the returned loss. The loss is this micro-batch's share of the *global*
aggregate (over all micro-batches and data-parallel ranks), multiplied by the DP size so that
data-parallel gradient averaging yields the global gradient: 1 rank and N ranks train alike.
Metrics are shares of global means too, so summing them over micro-batches and ranks gives means
(``_max`` keys are maxima: :mod:`posttrain.metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.algorithms.kl import kl_penalty

if TYPE_CHECKING:
    import torch

    from posttrain.protocol import SequenceBatch


class PolicyLoss:
    def __init__(self, algorithm: Any):
        self.algorithm = algorithm

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: SequenceBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        import torch

        cfg = self.algorithm
        mask = batch.response_mask[:, : logprobs.shape[1]].to(logprobs.dtype)
        old = batch["old_logprobs"][:, : logprobs.shape[1]].to(logprobs.dtype)
        adv = batch["advantages"][:, : logprobs.shape[1]].to(logprobs.dtype)

        low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
        high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
        log_ratio = torch.clamp(logprobs - old, min=-20.0, max=20.0)
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
        per_token = torch.maximum(unclipped, clipped)
        clip_frac = (clipped > unclipped).to(logprobs.dtype)

        kl = None
        if cfg.kl_coef and cfg.kl_mode == "loss" and "ref_logprobs" in batch.tensors:
            ref = batch["ref_logprobs"][:, : logprobs.shape[1]].to(logprobs.dtype)
            kl = kl_penalty(logprobs, ref, cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
        if entropy is not None and cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy

        meta = batch.meta
        dp_size = int(meta.get("dp_size", 1))
        loss = aggregate(per_token, mask, cfg.loss_agg_mode, meta) * dp_size

        def share(values: torch.Tensor) -> float:
            return float(aggregate(values.detach(), mask, "token-mean", meta))

        metrics = {
            "actor/pg_loss": share(torch.maximum(unclipped, clipped)),
            "actor/clip_frac": share(clip_frac),
            "actor/approx_kl_old": share(-log_ratio),
        }
        if entropy is not None:
            metrics["actor/entropy"] = share(entropy)
        if kl is not None:
            metrics["actor/kl_loss"] = share(kl)
        if meta.get("measure_rollout_mismatch"):
            # Old log-probs are the rollout's and the policy has not moved yet: the difference
            # is the rollout engine's disagreement with the trainer (sync bugs, dtypes).
            diff = (logprobs.detach() - old).abs() * mask
            metrics["rollout/logprob_diff_mean"] = share(diff)
            metrics["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        return loss, metrics


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, meta: dict[str, Any]
) -> torch.Tensor:
    """This micro-batch's share of the global aggregate.

    ``meta["global_tokens"]`` / ``meta["global_seqs"]`` count response tokens / sequences of the
    whole optimizer step over every rank; they are set by the driver.
    """
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / max(float(meta["global_tokens"]), 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=1).sum() / max(float(meta["global_seqs"]), 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(float(meta["global_seqs"]), 1.0)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
