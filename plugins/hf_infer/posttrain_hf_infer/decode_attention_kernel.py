"""The static decode's one-token attention on a GPU as a Triton kernel: each program reads one
KV head's keys and values of one row once, for all the query heads sharing it (padded up to
``tl.dot``'s 16 rows), with an online softmax, and stops at the row's last visible slot.

cuDNN's kernel always reads the whole window, and a window is rounded up to 128 slots past the
latest query: a fifth of the slots it read in a 512-token generation were masked. At 256 rows
of a 1.5B model on an H200 this kernel took 6.4 / 26 / 41 us a layer where cuDNN's took
15 / 31 / 46 (128 / 384 / 640-slot windows, the rows' keys seen up to 64 slots before the
window's end). With few rows cuDNN's reads faster (64 rows: 16 us against 11 at 640 slots):
one program per row and KV head leaves the GPU's memory system idle.

The mask is the decode's additive one ``[rows, 1, 1, window]``: 0 where a key is seen, the
dtype's minimum where it is not. Keys after a row's last seen one are not read; the others are
added their bias, as SDPA does. Every row sees at least one key (a query sees itself).

This module imports Triton: it is imported only where the decode runs on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The fastest of 54 configurations at 256 rows of a 1.5B model (12 query heads on 2 KV heads of
# 128) on an H200, over windows of 128 to 640 slots. Cutting a row's keys among several programs
# (flash-decoding's split, merged by log-sum-exp) was slower at 256 rows and did not beat cuDNN
# at 16 or 64 rows: not kept.
BLOCK_N = 32  # keys a program reads per iteration
WARPS = 4
STAGES = 3
MIN_GROUP = 16  # tl.dot's smallest M: the query heads of a group are padded up to it


@triton.jit
def _last_seen(
    mask_row: tl.tensor, window: tl.tensor, masked: tl.tensor, BLOCK_N: tl.constexpr
) -> tl.tensor:
    """One past the last slot of ``mask_row`` whose bias is above ``masked`` (0 when none)."""
    end = tl.full([], 0, tl.int32)
    for start in range(0, window, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        bias = tl.load(mask_row + n, mask=n < window, other=float("-inf")).to(tl.float32)
        end = tl.maximum(end, tl.max(tl.where(bias > masked, n + 1, 0), 0))
    return end


@triton.jit
def _attention_kernel(
    query: tl.tensor,
    key: tl.tensor,
    value: tl.tensor,
    mask: tl.tensor,
    out: tl.tensor,
    scale: tl.tensor,
    masked: tl.tensor,
    window: tl.tensor,
    groups: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_kb: tl.tensor,
    stride_kh: tl.tensor,
    stride_kn: tl.tensor,
    stride_vb: tl.tensor,
    stride_vh: tl.tensor,
    stride_vn: tl.tensor,
    stride_mb: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    row, kv_head = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, GROUP)
    d = tl.arange(0, DIM)
    live = g < groups
    heads = kv_head * groups + g
    q = tl.load(
        query + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    mask_row = mask + row * stride_mb
    end = _last_seen(mask_row, window, masked, BLOCK_N)
    keys = key + row * stride_kb + kv_head * stride_kh
    values = value + row * stride_vb + kv_head * stride_vh

    top = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, DIM], tl.float32)
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(keys + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
        bias = tl.load(mask_row + n, mask=inside, other=float("-inf")).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale + bias[None, :]
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.exp(top - new_top)
        weights = tl.exp(scores - new_top[:, None])
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(values + n[:, None] * stride_vn + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        top = new_top

    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]  # no key seen: zeros, no NaN
    target = out + row * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(target, result.to(out.dtype.element_ty), mask=live[:, None])


@torch.library.custom_op("posttrain::decode_attention", mutates_args=())
def decode_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`decode_attention` as an operator: the compiled step calls it as it is."""
    return decode_attention(query, key, value, mask, scale)


@decode_attention_op.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query`` ``[rows, heads, 1, dim]``; ``key``/``value`` ``[rows, kv_heads, slots, dim]``
    (the cache: only the first ``window`` slots are read, ``window`` = ``mask.shape[-1]``);
    ``mask`` ``[rows, 1, 1, window]``. Returns ``[rows, 1, heads, dim]`` in the query's dtype."""
    query, key, value, mask = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, mask)
    )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    window = mask.shape[-1]
    mask = mask.expand(rows, 1, 1, window)  # a mask shared by the rows: their stride is 0
    out = torch.empty(rows, 1, heads, dim, dtype=query.dtype, device=query.device)
    masked = torch.finfo(mask.dtype).min
    _attention_kernel[(rows, kv_heads)](
        query,
        key,
        value,
        mask,
        out,
        scale,
        masked,
        window,
        groups,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        mask.stride(0),
        out.stride(0),
        out.stride(2),
        GROUP=max(MIN_GROUP, triton.next_power_of_2(groups)),
        DIM=dim,
        BLOCK_N=BLOCK_N,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return out
