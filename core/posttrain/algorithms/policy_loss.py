"""The policy-gradient loss shared by every training backend, and the core's surrogates.

Backends call ``PolicyLoss(algorithm, term)(logprobs, entropy, micro_batch)`` per micro-batch and
call ``backward()`` on the returned loss. The loss is this micro-batch's share of the *global*
aggregate (over all micro-batches and data-parallel ranks), multiplied by the DP size so that
data-parallel gradient averaging yields the global gradient: 1 rank and N ranks train alike.
Metrics are shares of global means too, so summing them over micro-batches and ranks gives means
(``_max`` keys are maxima: :mod:`posttrain.training.metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.algorithms.kl import kl_penalty

if TYPE_CHECKING:
    import torch

    from posttrain.algorithms.registry import PolicyLossTerm
    from posttrain.config.sections import AlgorithmConfig
    from posttrain.protocol import SequenceBatch


def clip_bounds(cfg: Any) -> tuple[float, float]:
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    return low, high


def ppo_surrogate(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, with dual-clip (Ye et al. 2020): for negative advantages the
    loss is also capped at ``-adv * clip_ratio_c``, so one huge ratio cannot dominate."""
    import torch

    low, high = clip_bounds(cfg)
    log_ratio = torch.clamp(logprobs - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (clipped > unclipped).to(logprobs.dtype), "approx_kl_old": -log_ratio}
    if cfg.clip_ratio_c is not None:
        capped = torch.minimum(per_token, -adv * cfg.clip_ratio_c)
        dual = (adv < 0) & (capped < per_token)
        per_token = torch.where(adv < 0, capped, per_token)
        stats["dual_clip_frac"] = dual.to(logprobs.dtype)
    return per_token, stats


def gspo_surrogate(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of its
    tokens' ratios, clipped as a whole; each token carries it with its own gradient."""
    import torch

    low, high = clip_bounds(cfg)
    log_ratio = torch.clamp(logprobs - old, min=-20.0, max=20.0) * mask
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(
        min=1.0
    )
    # s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): the value of s_i, the gradient of token t.
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=20.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {
        "clip_frac": (clipped > unclipped).to(logprobs.dtype),
        "approx_kl_old": -log_ratio,
    }
    return per_token, stats


class PolicyLoss:
    """The loss of one micro-batch: a registered surrogate (PPO's clipped one by default), the
    rollout-correction weights, the KL and entropy terms, and the aggregation."""

    def __init__(self, algorithm: Any, term: PolicyLossTerm | None = None):
        self.algorithm = algorithm
        self.surrogate = term.surrogate if term is not None else ppo_surrogate

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: SequenceBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.algorithm
        width = logprobs.shape[1]
        mask = batch.response_mask[:, :width].to(logprobs.dtype)
        old = batch["old_logprobs"][:, :width].to(logprobs.dtype)
        adv = batch["advantages"][:, :width].to(logprobs.dtype)

        per_token, stats = self.surrogate(logprobs, old, adv, mask, cfg)
        pg_loss = per_token.detach()
        if "tis_weights" in batch.tensors:
            # Truncated importance sampling: the samples came from the rollout engine's
            # distribution, not the trainer's old policy (see posttrain.algorithms.correction).
            per_token = per_token * batch["tis_weights"][:, :width].to(logprobs.dtype)

        kl = None
        if cfg.kl_coef and cfg.kl_mode == "loss" and "ref_logprobs" in batch.tensors:
            ref = batch["ref_logprobs"][:, :width].to(logprobs.dtype)
            kl = kl_penalty(logprobs, ref, cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
        if entropy is not None and cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy

        meta = batch.meta
        dp_size = int(meta.get("dp_size", 1))
        loss = aggregate(per_token, mask, cfg.loss_agg_mode, meta) * dp_size

        def share(values: torch.Tensor) -> float:
            return float(aggregate(values.detach(), mask, "token-mean", meta))

        metrics = {"actor/pg_loss": share(pg_loss)}
        metrics.update({f"actor/{name}": share(value) for name, value in stats.items()})
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
