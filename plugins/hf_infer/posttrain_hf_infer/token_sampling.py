"""``hf_infer``'s token sampling: one token per row from a step's logits, and its log-probability
under the model's own distribution (temperature 1, before top-k/top-p: what a forward pass scores).

:func:`draw` is the general path (temperature, top-k, top-p, greedy at temperature 0).
:func:`gumbel_draw` serves the plain sampling RL runs most (temperature only) in the ``compiled``
decode: ``argmax(logits / T + Gumbel noise)`` samples the softmax of ``logits / T`` exactly (the
Gumbel-max trick) in one pass over the logits instead of the general path's half-dozen
(``float``, log-softmax, scaling, softmax, multinomial, gather: 0.9 ms of a 7 ms graphed 1.5B
step at 256 rows on an H200).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posttrain import SamplingParams

# A token per row and its log-probability at temperature 1.
Drawn = tuple[torch.Tensor, torch.Tensor]
# A step's sampling: the logits ``[rows, vocab]`` in, what it drew out.
Draw = Callable[[torch.Tensor], Drawn]


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    logits = logits / max(temperature, 1e-6)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def draw(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> Drawn:
    """One token per row from ``logits`` (temperature, top-k, top-p; greedy at temperature 0)
    and its log-probability under the unfiltered distribution (what a forward pass scores)."""
    logits = logits.float()
    raw_logp = torch.log_softmax(logits, dim=-1)
    filtered = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if sampling.temperature <= 0:
        token = filtered.argmax(-1)
    else:
        probs = torch.softmax(filtered, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, raw_logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def is_plain(sampling: SamplingParams) -> bool:
    """Sampling at a temperature with no top-k/top-p filter (what :func:`gumbel_draw` does)."""
    return sampling.temperature > 0 and sampling.top_k <= 0 and sampling.top_p >= 1.0


def gumbel_choice(logits: torch.Tensor, uniform: torch.Tensor, temperature: float) -> Drawn:
    """The token ``argmax(logits / T - log(-log(u)))`` of each row and its log-probability at
    temperature 1. ``uniform`` in [0, 1): a 0 gives the token -inf (never chosen)."""
    logits = logits.float()
    token = (logits / temperature - torch.log(-torch.log(uniform))).argmax(-1)
    chosen = logits.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token, chosen - torch.logsumexp(logits, dim=-1)


_compiled_choice: Callable[[torch.Tensor, torch.Tensor, float], Drawn] | None = None


def gumbel_draw(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> Drawn:
    """:func:`gumbel_choice` as one kernel, its noise drawn from ``generator``: on a GPU the
    Triton kernel of :mod:`~posttrain_hf_infer.gumbel_kernel` (uniforms drawn in registers),
    elsewhere the compiled function reading uniforms ``torch.rand`` wrote."""
    if logits.is_cuda:
        from posttrain_hf_infer.gumbel_kernel import gumbel_max

        return gumbel_max(logits, temperature, generator)
    global _compiled_choice
    if _compiled_choice is None:
        _compiled_choice = torch.compile(gumbel_choice, fullgraph=True)
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device)
    return _compiled_choice(logits, uniform, temperature)
