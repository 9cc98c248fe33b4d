"""Per-token log-probs and entropy from logits split over tensor-parallel ranks (vocab dim).

Gathering [b, s, vocab] logits on every TP rank would cost TP times the memory of the largest
activation; megatron's ``vocab_parallel_cross_entropy`` and the entropy below reduce over the
vocabulary with three all-reduces of [b, s] tensors instead. Both are aligned like
:func:`posttrain.modeling.shifted_token_logprobs`: ``out[:, t]`` scores ``input_ids[:, t]``
and ``out[:, 0] = 0``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Logit of the padding columns (the vocabulary is padded to split over TP ranks): exp() is 0 and
# 0 * it stays finite, unlike -inf.
_MASKED = -1e30


def _scores(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 next-token scores [b, s-1, vocab / tp] with padding columns masked out."""
    from megatron.core import parallel_state

    # A copy: megatron's cross entropy works in place on its input.
    scores = logits[:, :-1].to(torch.float32, copy=True).contiguous()
    width = scores.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    if start + width > vocab_size:
        scores[..., max(0, vocab_size - start) :] = _MASKED
    return scores


def shifted_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``logits``: [b, s, padded vocab / tp] of this TP rank; ``vocab_size``: the real one."""
    return _logprobs_of(_scores(logits, vocab_size), input_ids)


def _logprobs_of(scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Consumes ``scores`` (megatron's cross entropy overwrites it)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    nll = vocab_parallel_cross_entropy(scores, input_ids[:, 1:].contiguous())
    return torch.nn.functional.pad(-nll, (1, 0))


def logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both per-token tensors; without ``entropy_grad`` one float32 copy of the logits serves
    both (the entropy is read before the cross entropy overwrites it), which matters at a
    150k vocabulary."""
    if entropy_grad:
        return shifted_logprobs(logits, input_ids, vocab_size), shifted_entropy(logits, vocab_size)
    scores = _scores(logits, vocab_size)
    with torch.no_grad():
        entropy = _entropy_of(scores.detach())
    return _logprobs_of(scores, input_ids), entropy


def _entropy_tp(scores: torch.Tensor, group) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z) over the whole vocabulary; differentiable (the
    all-reduces of :mod:`torch.distributed.nn` pass gradients back to every rank's shard)."""
    from torch.distributed.nn.functional import all_reduce

    z_max = scores.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scores - z_max
    lse = all_reduce(shifted.exp().sum(-1), group=group).log()
    probs = (shifted - lse.unsqueeze(-1)).exp()
    return lse - all_reduce((probs * shifted).sum(-1), group=group)


def shifted_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return _entropy_of(_scores(logits, vocab_size))


def _entropy_of(scores: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        logp = torch.log_softmax(scores, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        ent = _entropy_tp(scores, group)
    return torch.nn.functional.pad(ent, (1, 0))
