"""Triton kernels of :mod:`posttrain_megatron.token_scores` (CUDA; imported only there).

One program per row of logits. ``partials`` reads the row twice (max, then the sums: a second
read of 300 KB is cheaper than rescaling running sums at every block), ``gradient`` reads it
once and writes the gradient in the logits' dtype. Sums are float32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_WARPS = 8


# Triton reads a kernel's parameter annotations (``tl.constexpr``, dtype names): ``tl.tensor``,
# what a scalar or pointer argument is inside the kernel, changes nothing in its specialisation.
@triton.jit
def _partials_kernel(
    logits_ptr: tl.tensor,
    row_stride: tl.tensor,
    local_ptr: tl.tensor,
    out_ptr: tl.tensor,
    rows: tl.tensor,
    valid: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    offsets = tl.arange(0, BLOCK)

    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, valid, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < valid, other=float("-inf")).to(tl.float32)
        running_max = tl.maximum(running_max, x)
    m = tl.max(running_max, axis=0)

    sum_exp = tl.zeros([BLOCK], tl.float32)
    sum_exp_shifted = tl.zeros([BLOCK], tl.float32)
    for start in range(0, valid, BLOCK):
        cols = start + offsets
        inside = cols < valid
        d = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) - m
        e = tl.where(inside, tl.exp(d), 0.0)
        sum_exp += e
        sum_exp_shifted += e * d

    target = tl.load(local_ptr + row)
    hit = target >= 0
    picked = tl.load(base + tl.where(hit, target, 0), mask=hit, other=0.0).to(tl.float32)

    tl.store(out_ptr + row, m)
    tl.store(out_ptr + rows + row, tl.sum(sum_exp, axis=0))
    tl.store(out_ptr + 2 * rows + row, tl.sum(sum_exp_shifted, axis=0))
    tl.store(out_ptr + 3 * rows + row, tl.where(hit, picked, 0.0))


@triton.jit
def _gradient_kernel(
    logits_ptr: tl.tensor,
    row_stride: tl.tensor,
    grad_ptr: tl.tensor,
    grad_row_stride: tl.tensor,
    local_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    mean_ptr: tl.tensor,
    grad_logp_ptr: tl.tensor,
    grad_entropy_ptr: tl.tensor,
    width: tl.tensor,
    valid: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    grad_base = grad_ptr + row * grad_row_stride
    offsets = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    mean = tl.load(mean_ptr + row)
    g_logp = tl.load(grad_logp_ptr + row)
    g_entropy = tl.load(grad_entropy_ptr + row)
    target = tl.load(local_ptr + row)
    for start in range(0, width, BLOCK):
        cols = start + offsets
        inside = cols < valid
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        # d log p(target) / dz = onehot - p;  d H / dz = -p (z - E_p[z])
        g = -p * (g_logp + g_entropy * (z - mean))
        g = tl.where(cols == target, g + g_logp, g)
        g = tl.where(inside, g, 0.0)
        tl.store(grad_base + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < width)


def partials(logits: torch.Tensor, local: torch.Tensor, valid: int) -> tuple[torch.Tensor, ...]:
    rows = logits.shape[0]
    out = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _partials_kernel[(rows,)](
            logits,
            logits.stride(0),
            local.contiguous(),
            out,
            rows,
            valid,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return tuple(out)


def gradient(
    logits: torch.Tensor,
    local: torch.Tensor,
    valid: int,
    lse: torch.Tensor,
    mean: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    if logits.shape[0]:
        _gradient_kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            grad,
            grad.stride(0),
            local.contiguous(),
            lse.contiguous(),
            mean.contiguous(),
            grad_logp,
            grad_entropy,
            logits.shape[1],
            valid,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return grad
