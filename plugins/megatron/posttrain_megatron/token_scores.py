"""Next-token log-probs and entropy from vocab-parallel logits, without a float32 copy of them.

At a 150k vocabulary the logits are the largest activation of a step (8192 tokens x 151,936
columns = 2.5 GB in bf16). Megatron's ``vocab_parallel_cross_entropy`` runs on a float32 copy
with one pass per op, forward and backward, and an entropy for the metrics costs as many again:
on one H200 that was more time than the rest of the gap to a transformers training step.

Here each token needs four numbers from its rank's vocabulary shard: the max logit ``m``,
``S = sum(exp(z - m))``, ``T = sum(exp(z - m) * (z - m))`` and the logit of its target. They are
combined over tensor-parallel ranks with two all-reduces of [tokens, .] tensors, and give
``log p(target) = z_target - m - log S`` and ``H = log S - T / S``. The backward pass recomputes
the softmax from the logits (kept in their own dtype) and writes their gradient in that dtype.
On CUDA both passes are Triton kernels (:mod:`posttrain_megatron.token_scores_triton`: one read of
the logits forward, one read and one write backward); elsewhere the same sums in torch ops over
chunks of rows.

The model computes these in place of its language-model loss (:func:`install`): megatron's
``GPTModel`` hands ``compute_language_model_loss`` the [s, b, vocab / tp] logits before it would
transpose them into a contiguous [b, s, vocab] copy, which this way is never made.

With ``logprob_chunk_tokens`` (:func:`chunked_next_token_scores`) the logits are never whole
either: called with labels, the output layer hands over its input and weight instead of its
product, and the scores are computed ``chunk`` tokens at a time, each chunk's logits made by the
same matrix product, reduced to the four sums and dropped; backward makes them again, chunk by
chunk, for the gradients of the hidden states and of the weight shard (as Liger's fused linear
cross-entropy, and core's :mod:`posttrain.scoring.chunked_logprobs`, but vocab-parallel). At
16k tokens x 151,936 columns that is 4.6 GiB of bf16 logits, and as much for their gradient,
down to two chunks' worth.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import Tensor

# Largest float32 temporary of the torch path, in elements (256 MiB).
_CHUNK_ELEMENTS = 1 << 26
# Label of a position without a next token (the last one of a row).
NO_TARGET = -1


def install(model: torch.nn.Module, vocab_size: int, chunk_tokens: int = 0) -> None:
    """Make ``model`` (a bare ``GPTModel`` chunk) answer a call with ``labels`` (the next token of
    each position, ``NO_TARGET`` for none) with [b, s, 2] float32 scores: the labels' log-probs
    and the entropy of each position's distribution over the real ``vocab_size`` columns (the
    padding columns that split the vocabulary over TP ranks are left out).

    ``chunk_tokens`` > 0: from the output layer's input ``chunk_tokens`` tokens at a time, never
    the whole logits (:func:`chunked_next_token_scores`). Called without labels the model still
    returns its logits."""
    state = _HeadState(chunk_tokens if _can_chunk(model) else 0)
    model.compute_language_model_loss = functools.partial(
        _model_scores, vocab_size=vocab_size, state=state
    )
    if state.chunk_tokens:
        layer = model.output_layer
        # GPTModel calls the output layer, then compute_language_model_loss with its result only
        # when it has labels: the model's pre-hook says which call this is.
        layer.forward = functools.partial(_output_layer_forward, layer, layer.forward, state)
        model.register_forward_pre_hook(
            functools.partial(_note_labels, state=state), with_kwargs=True
        )


def _can_chunk(model: torch.nn.Module) -> bool:
    """Whether this chunk's output layer can hand over its input instead of its product: it is
    the last stage, the layer has no bias (GPTModel builds it without), and nothing scales or
    defers its product (MuP output scaling, megatron's deferred embedding weight gradients)."""
    config = model.config
    return (
        bool(getattr(model, "post_process", False))
        and getattr(model.output_layer, "bias", None) is None
        and not getattr(config, "use_mup", False)
        and not getattr(config, "defer_embedding_wgrad_compute", False)
    )


class _HeadState:
    """The chunk size, and whether the model's current call has labels (set by its pre-hook)."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens
        self.scoring = False


class HeadInput:
    """What the output layer hands ``compute_language_model_loss`` in place of its logits when
    chunked: its input [s(/tp with SP), b, hidden] and weight [vocab / tp, hidden]."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool):
        self.hidden = hidden
        self.weight = weight
        self.sequence_parallel = sequence_parallel


def _note_labels(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, state: _HeadState
) -> None:
    # The plugin calls its models with keyword arguments only (training._run_schedule).
    state.scoring = kwargs.get("labels") is not None


def _output_layer_forward(
    layer: torch.nn.Module,
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    state: _HeadState,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor | HeadInput, torch.Tensor | None]:
    if not state.scoring or kwargs.get("runtime_gather_output"):
        return forward(input_, weight=weight, **kwargs)
    weight = layer.weight if weight is None else weight
    return HeadInput(input_, weight, bool(layer.sequence_parallel)), None


def _model_scores(
    labels: torch.Tensor, logits: torch.Tensor | HeadInput, vocab_size: int, state: _HeadState
) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    if isinstance(logits, HeadInput):
        return _chunked_model_scores(labels, logits, vocab_size, state.chunk_tokens, group, rank)
    s, b, width = logits.shape
    logp, entropy = next_token_scores(
        logits.reshape(s * b, width),
        labels.transpose(0, 1).reshape(s * b),
        vocab_start=rank * width,
        vocab_size=vocab_size,
        group=group,
    )
    return torch.stack([logp, entropy], dim=-1).view(s, b, 2).transpose(0, 1)


def _chunked_model_scores(
    labels: torch.Tensor,
    head: HeadInput,
    vocab_size: int,
    chunk: int,
    group: dist.ProcessGroup,
    rank: int,
) -> torch.Tensor:
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    # What ColumnParallelLinear does with its input: with sequence parallelism gather the
    # sequence (backward: reduce-scatter), else sum the input's gradient over TP ranks (each
    # rank's holds its vocabulary shard's share); both are the identity at TP1.
    if head.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            head.hidden, tensor_parallel_output_grad=True, group=group
        )
    else:
        hidden = copy_to_tensor_model_parallel_region(head.hidden, group=group)
    s, b, width = hidden.shape
    logp, entropy = chunked_next_token_scores(
        hidden.reshape(s * b, width),
        head.weight,
        labels.transpose(0, 1).reshape(s * b),
        vocab_start=rank * head.weight.shape[0],
        vocab_size=vocab_size,
        chunk_tokens=chunk,
        group=group,
    )
    return torch.stack([logp, entropy], dim=-1).view(s, b, 2).transpose(0, 1)


def aligned(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Model scores [b, s, 2] as ``(logprobs, entropy)`` aligned like
    :func:`posttrain.shifted_token_logprobs`: ``out[:, t]`` scores ``input_ids[:, t]``
    (from position t - 1's distribution) and ``out[:, 0] = 0``."""
    shifted = torch.nn.functional.pad(scores[:, :-1], (0, 0, 1, 0))
    return shifted[..., 0], shifted[..., 1]


def next_token_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` per row, float32, differentiable in ``logits``.

    ``logits``: [rows, width], this rank's columns ``vocab_start .. vocab_start + width`` of the
    vocabulary; columns at or past ``vocab_size`` are padding and take no part. ``targets``:
    [rows] global token ids, ``NO_TARGET`` where there is none (its log-prob is then
    ``-logsumexp``, meaningless: mask it). ``group``: the tensor-parallel group the vocabulary
    is split over (None or a group of one: not split)."""
    return _NextTokenScores.apply(logits, targets, vocab_start, vocab_size, group)


class _NextTokenScores(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        vocab_start: int,
        vocab_size: int,
        group: dist.ProcessGroup | None,
    ) -> tuple[Tensor, Tensor]:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        width = logits.shape[-1]
        valid = max(0, min(width, vocab_size - vocab_start))
        local = _local_targets(targets, logits.device, vocab_start, valid)
        m, s, t, target_logit = _impl(logits).partials(logits, local, valid)
        if group is not None and dist.get_world_size(group) > 1:
            m, s, t, target_logit = _combine(m, s, t, target_logit, group)
        log_s = s.log()
        lse = m + log_s
        mean = m + t / s  # E_p[z]
        ctx.save_for_backward(logits, local, lse, mean)
        ctx.valid = valid
        return target_logit - lse, log_s - t / s

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor, None, None, None, None]:
        logits, local, lse, mean = ctx.saved_tensors
        grad_logp, grad_entropy = _output_grads(grad_logp, grad_entropy, lse)
        grad = _impl(logits).gradient(logits, local, ctx.valid, lse, mean, grad_logp, grad_entropy)
        return grad, None, None, None, None


def chunked_next_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    chunk_tokens: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`next_token_scores` of the logits ``hidden @ weight.T`` without making them whole:
    ``chunk_tokens`` rows at a time, forward and again in backward. Differentiable in ``hidden``
    [rows, h] (its gradient is this shard's share: the caller sums it over ``group``) and
    ``weight`` [width, h], this rank's vocabulary shard."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedNextTokenScores.apply(
        hidden, weight, targets, vocab_start, vocab_size, chunk_tokens, group
    )


def _local_targets(
    targets: Tensor, device: torch.device, vocab_start: int, valid: int
) -> torch.Tensor:
    """Targets as column indices of this shard; NO_TARGET where the target is elsewhere."""
    targets = targets.to(device=device, dtype=torch.int64)
    local = targets - vocab_start
    return torch.where((targets >= 0) & (local >= 0) & (local < valid), local, NO_TARGET)


def _output_grads(
    grad_logp: Tensor | None, grad_entropy: Tensor | None, like: Tensor
) -> tuple[Tensor, Tensor]:
    """The outputs' gradients as contiguous float32 (zeros for an output without one)."""
    if grad_logp is None or grad_entropy is None:
        zeros = torch.zeros_like(like)
        grad_logp = zeros if grad_logp is None else grad_logp
        grad_entropy = zeros if grad_entropy is None else grad_entropy
    return grad_logp.float().contiguous(), grad_entropy.float().contiguous()


class _ChunkedNextTokenScores(torch.autograd.Function):
    """Saves the inputs and two floats per token; each chunk's logits live only while its sums
    (forward) or its gradient (backward) are computed, by the same kernels as the whole logits'."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        vocab_start: int,
        vocab_size: int,
        chunk: int,
        group: dist.ProcessGroup | None,
    ) -> tuple[Tensor, Tensor]:
        rows, width = hidden.shape[0], weight.shape[0]
        valid = max(0, min(width, vocab_size - vocab_start))
        local = _local_targets(targets, hidden.device, vocab_start, valid)
        sums = torch.empty(4, rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            logits = torch.nn.functional.linear(hidden[start:end], weight)
            partials = _impl(logits).partials(logits, local[start:end], valid)
            sums[:, start:end] = torch.stack(partials)
            del logits
        m, s, t, target_logit = sums
        if group is not None and dist.get_world_size(group) > 1:
            m, s, t, target_logit = _combine(m, s, t, target_logit, group)
        log_s = s.log()
        lse = m + log_s
        mean = m + t / s  # E_p[z]
        ctx.save_for_backward(hidden, weight, local, lse, mean)
        ctx.valid = valid
        ctx.chunk = chunk
        return target_logit - lse, log_s - t / s

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None]:
        hidden, weight, local, lse, mean = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_logp, grad_entropy = _output_grads(grad_logp, grad_entropy, lse)
        rows, chunk = hidden.shape[0], ctx.chunk
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight: Tensor | None = None
        # One chunk: its product is the whole one, in the weight's dtype. Several: summed in
        # float32 (a low-precision running sum would round at every chunk where the unchunked
        # product rounds once), cast once.
        several = rows > chunk
        if need_weight and several:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            h = hidden[start:end]
            logits = torch.nn.functional.linear(h, weight)
            grad_logits = _impl(logits).gradient(
                logits,
                local[start:end],
                ctx.valid,
                lse[start:end],
                mean[start:end],
                grad_logp[start:end],
                grad_entropy[start:end],
            )
            del logits
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                product = grad_logits.t() @ h
                if grad_weight is not None:  # several chunks: the float32 sum
                    grad_weight.add_(product)
                else:
                    grad_weight = product
                del product
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _combine(
    m: Tensor, s: Tensor, t: Tensor, target_logit: Tensor, group: dist.ProcessGroup
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The shards' partial sums as sums over the whole vocabulary (every TP rank gets them)."""
    global_m = m.clone()
    dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=group)
    shift = m - global_m
    # A shard without real columns (s == 0) adds nothing; guards 0 * -inf.
    scale = torch.where(s > 0, shift.exp(), 0.0)
    sums = torch.stack([s * scale, torch.where(s > 0, scale * (t + shift * s), 0.0), target_logit])
    dist.all_reduce(sums, group=group)
    return global_m, sums[0], sums[1], sums[2]


class _Kernels(Protocol):
    """What computes a shard's sums and gradient: :class:`TorchScores`, or the Triton kernels
    of :mod:`posttrain_megatron.token_scores_triton` (a module of the same two functions)."""

    def partials(self, logits: Tensor, local: Tensor, valid: int, /) -> tuple[Tensor, ...]: ...

    def gradient(
        self,
        logits: Tensor,
        local: Tensor,
        valid: int,
        lse: Tensor,
        mean: Tensor,
        grad_logp: Tensor,
        grad_entropy: Tensor,
        /,
    ) -> Tensor: ...


def _impl(logits: torch.Tensor) -> _Kernels:
    if logits.is_cuda and _have_triton():
        from posttrain_megatron import token_scores_triton

        return token_scores_triton
    return TorchScores


@functools.cache
def _have_triton() -> bool:
    # Triton ships with torch's CUDA wheels; a torch built without it takes the torch path.
    import importlib.util

    return importlib.util.find_spec("triton") is not None


class TorchScores:
    """The sums and the gradient in torch ops, a chunk of rows at a time (float32 temporaries
    of at most ``_CHUNK_ELEMENTS``)."""

    @staticmethod
    def _chunks(logits: Tensor) -> tuple[range, int]:
        step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
        return range(0, logits.shape[0], step), step

    @staticmethod
    def partials(logits: Tensor, local: Tensor, valid: int) -> tuple[Tensor, ...]:
        rows = logits.shape[0]
        out = torch.zeros(4, rows, dtype=torch.float32, device=logits.device)
        out[0] = float("-inf")
        if valid == 0:
            return tuple(out)
        starts, step = TorchScores._chunks(logits)
        for start in starts:
            z = logits[start : start + step, :valid].float()
            m = z.amax(-1)
            d = z - m.unsqueeze(-1)
            e = d.exp()
            idx = local[start : start + step]
            hit = idx >= 0
            picked = z.gather(1, idx.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            out[0, start : start + step] = m
            out[1, start : start + step] = e.sum(-1)
            out[2, start : start + step] = (e * d).sum(-1)
            out[3, start : start + step] = torch.where(hit, picked, 0.0)
        return tuple(out)

    @staticmethod
    def gradient(
        logits: Tensor,
        local: Tensor,
        valid: int,
        lse: Tensor,
        mean: Tensor,
        grad_logp: Tensor,
        grad_entropy: Tensor,
    ) -> Tensor:
        grad = torch.zeros_like(logits)
        starts, step = TorchScores._chunks(logits)
        for start in starts:
            rows = slice(start, start + step)
            z = logits[rows, :valid].float()
            p = (z - lse[rows].unsqueeze(-1)).exp()
            g = -p * (
                grad_logp[rows].unsqueeze(-1)
                + grad_entropy[rows].unsqueeze(-1) * (z - mean[rows].unsqueeze(-1))
            )
            idx = local[rows]
            g.scatter_add_(
                1,
                idx.clamp(min=0).unsqueeze(-1),
                torch.where(idx >= 0, grad_logp[rows], 0.0).unsqueeze(-1),
            )
            grad[rows, :valid] = g.to(grad.dtype)
        return grad
