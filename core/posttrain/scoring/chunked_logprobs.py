"""Per-token log-probs and entropy from final hidden states without full-vocabulary logits.

``log_softmax(lm_head(h))`` over a micro-batch materialises ``[tokens, vocab]`` float32 logits,
their softmax and their gradient: 5.7 GiB for 9.5k tokens of a 151,936-token vocabulary. Here the
logits exist ``chunk_tokens`` rows at a time, in forward and again (recomputed) in backward, as in
Liger's fused linear cross-entropy. Each chunk's logits are the same matrix product ``lm_head``
computes (in the model's dtype), then float32, so the log-probs equal the unchunked path's within
float32 rounding.
"""

from __future__ import annotations

import torch


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, float32 ``[N]``: ``logp[i] = log_softmax(z_i)[targets[i]]`` and the
    entropy of ``softmax(z_i)``, where ``z_i = (hidden[i] @ weight.T + bias).float() /
    temperature``; ``hidden`` is ``[N, H]``, ``weight`` ``[V, H]``, ``targets`` ``[N]``.
    Without ``with_entropy`` the entropy is zeros (and costs nothing). Differentiable with
    respect to ``hidden``, ``weight`` and ``bias``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk_tokens), with_entropy
    )


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the model's dtype (float64 stays float64: gradcheck runs in it)."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_logits(h, weight, bias, temperature: float) -> torch.Tensor:
    """One chunk's logits as ``lm_head`` gives them (model dtype), then float32 / temperature."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(_float_dtype(z.dtype))
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    """Saves only the inputs and two floats per token (log-sum-exp, entropy); backward
    recomputes each chunk's logits.

    With ``z`` the scaled logits, ``lp = z - lse`` and ``p = exp(lp)``:
    ``d logp / dz = onehot(target) - p`` and ``d entropy / dz = -p * (lp + entropy)``; the
    logits' gradient is their sum weighted by the outputs' gradients, over ``temperature``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_float_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _scaled_logits(hidden[start:end], weight, bias, temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:end] = chunk_lse
            picked = z.gather(-1, targets[start:end, None]).squeeze(-1)
            logp[start:end] = picked - chunk_lse
            if with_entropy:
                lp = z.sub_(chunk_lse[:, None])
                entropy[start:end] = -(lp.exp() * lp).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.with_entropy = with_entropy
        # An output whose gradient nobody asks for comes in as None: no entropy term then.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
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
            lp = _scaled_logits(h, weight, bias, temperature).sub_(lse[start:end, None])
            p = lp.exp()
            if grad_entropy is not None:
                # -p * (lp + H), times the entropy's gradient.
                grad_z = lp.add_(entropy[start:end, None]).mul_(p)
                grad_z.mul_(-grad_entropy[start:end, None])
                if grad_logp is not None:
                    grad_z.sub_(p.mul_(grad_logp[start:end, None]))
            else:
                grad_z = p.mul_(-grad_logp[start:end, None])
            if grad_logp is not None:
                grad_z.scatter_add_(-1, targets[start:end, None], grad_logp[start:end, None])
            del lp, p
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits = grad_z.to(hidden.dtype)
            del grad_z
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
        )
