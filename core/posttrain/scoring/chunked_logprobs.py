"""Per-token log-probs and entropy from final hidden states without full-vocabulary logits.

``log_softmax(lm_head(h))`` over a micro-batch materialises ``[tokens, vocab]`` float32 logits,
their softmax and their gradient: 5.7 GiB for 9.5k tokens of a 151,936-token vocabulary. Here the
logits exist ``chunk_tokens`` rows at a time, in forward and again (recomputed) in backward, as in
Liger's fused linear cross-entropy. Each chunk's logits are the same matrix product ``lm_head``
computes (in the model's dtype), then float32, so the log-probs equal the unchunked path's within
float32 rounding.

On a GPU the work on each chunk's logits after that product (log-sum-exp, the target's log-prob,
the entropy; in backward the logits' gradient) is compiled into a few fused kernels that read the
logits in the model's dtype: run eagerly, those passes over float32 ``[chunk, vocab]`` tensors cost
as much as the matrix products (1.5B, 10k tokens, H200: 21 ms of log-sum-exp alone in a 84 ms
reference forward). Elsewhere they run eagerly, in place, to keep memory low.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, float32 ``[N]``: ``logp[i] = log_softmax(z_i)[targets[i]]`` and the
    entropy of ``softmax(z_i)``, where ``z_i = (hidden[i] @ weight.T + bias).float() /
    temperature``; ``hidden`` is ``[N, H]``, ``weight`` ``[V, H]``, ``targets`` ``[N]``.
    Without ``with_entropy`` the entropy is zeros (and costs nothing). Differentiable with
    respect to ``hidden``, ``weight`` and ``bias``. ``fused``: the chunks' element-wise work
    compiled (default: on a GPU)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if fused is None:
        fused = hidden.is_cuda
    return _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk_tokens), with_entropy, fused
    )


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the model's dtype (float64 stays float64: gradcheck runs in it)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp, the target's log-prob and the entropy (zeros without ``with_entropy``) of
    one chunk's logits ``z`` as the head gives them, each float32 ``[n]``. Run eagerly (the head's
    logits no longer referenced once copied, the copy reused in place) or compiled, where the
    in-place step costs nothing: inductor fuses the whole into a few kernels."""
    z = z.to(_float_dtype(z.dtype))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, torch.zeros_like(lse)
    lp = z.sub_(lse[:, None])
    return lse, logp, -(lp.exp() * lp).sum(-1)


def chunk_logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient of one chunk's logits ``z`` (in their dtype) from the outputs' gradients
    (either may be None); :func:`_logit_grad` computes the same eagerly, in place."""
    scaled = z.to(_float_dtype(z.dtype))
    if temperature != 1.0:
        scaled = scaled / temperature
    lp = scaled - lse[:, None]
    p = lp.exp()
    grad = torch.zeros_like(lp)
    if grad_entropy is not None:
        grad = (lp + entropy[:, None]) * p * -grad_entropy[:, None]
    if grad_logp is not None:
        grad = grad - p * grad_logp[:, None]
        vocab = torch.arange(z.shape[-1], device=z.device)
        grad = torch.where(vocab == targets[:, None], grad + grad_logp[:, None], grad)
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(z.dtype)


@functools.cache
def compiled_once(function: _F) -> _F:
    """``function`` through ``torch.compile``, shape-generic (chunk and vocabulary sizes). It
    compiles again per dtype, per variant (entropy or not, which gradients come, a temperature)
    and for a last chunk of one row; past torch's recompile limit a call runs the function
    uncompiled (same values), not an error."""
    return torch.compile(function, dynamic=True)


class _ChunkedLogprobs(torch.autograd.Function):
    """Saves only the inputs and two floats per token (log-sum-exp, entropy); backward
    recomputes each chunk's logits.

    With ``z`` the scaled logits, ``lp = z - lse`` and ``p = exp(lp)``:
    ``d logp / dz = onehot(target) - p`` and ``d entropy / dz = -p * (lp + entropy)``; the
    logits' gradient is their sum weighted by the outputs' gradients, over ``temperature``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_float_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            stats = _stats(
                # Not referenced here: in the eager path their float32 copy replaces them.
                torch.nn.functional.linear(hidden[start:end], weight, bias),
                targets[start:end],
                temperature,
                with_entropy,
                fused,
            )
            lse[start:end], logp[start:end], entropy[start:end] = stats
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.with_entropy = with_entropy
        ctx.fused = fused
        # An output whose gradient nobody asks for comes in as None: no entropy term then.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        temperature, n = ctx.temperature, hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in float32, cast once: a low-precision running sum would round at
        # every chunk where the unchunked product rounds once.
        acc = _float_dtype(weight.dtype)
        grad_weight = grad_bias = None
        if need_weight:
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if need_bias and bias is not None:
            grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device)
        for start in range(0, n, ctx.chunk):
            end = min(start + ctx.chunk, n)
            h = hidden[start:end]
            grad_logits = _logit_grad(
                torch.nn.functional.linear(h, weight, bias),
                lse[start:end],
                entropy[start:end],
                targets[start:end],
                None if grad_logp is None else grad_logp[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
                temperature,
                ctx.fused,
            )
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                if grad_logits.dtype == acc:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight += (grad_logits.t() @ h).to(acc)
            if grad_bias is not None:
                grad_bias += grad_logits.to(acc).sum(0)
            del grad_logits
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def _stats(
    z: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunk_stats`, compiled or eager."""
    stats = compiled_once(chunk_stats) if fused else chunk_stats
    return stats(z, targets, temperature, with_entropy)


def _logit_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    fused: bool,
) -> torch.Tensor:
    """:func:`chunk_logit_grad`, compiled, or computed eagerly in place (the float32 logits'
    buffer reused: no more than two chunk-sized float32 tensors at once)."""
    if fused:
        args = z, lse, entropy, targets, grad_logp, grad_entropy, temperature
        return compiled_once(chunk_logit_grad)(*args)
    dtype = z.dtype
    lp = z.to(_float_dtype(dtype))
    del z  # the head's logits: only their float32 copy is needed from here
    if temperature != 1.0:
        lp = lp.div_(temperature)
    lp = lp.sub_(lse[:, None])
    p = lp.exp()
    if grad_entropy is not None:
        # -p * (lp + H), times the entropy's gradient.
        grad_z = lp.add_(entropy[:, None]).mul_(p)
        grad_z.mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            grad_z.sub_(p.mul_(grad_logp[:, None]))
    else:
        # backward returns before any chunk when neither output has a gradient.
        assert grad_logp is not None
        grad_z = p.mul_(-grad_logp[:, None])
    if grad_logp is not None:
        grad_z.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    if temperature != 1.0:
        grad_z.div_(temperature)
    return grad_z.to(dtype)
