"""Chunked log-probs against the full logits, for backend tests that drive engines by hand.

A strategy with ``logprob_chunk_tokens`` computes old log-probs through
:func:`~posttrain.scoring.chunked_logprobs.chunked_token_logprobs` instead of the full logits;
the test proves both give the same numbers. :func:`chunked_vs_full` runs each setting on a fresh
model and counts the chunked head's calls, so the test also sees that chunking really happened
(and that chunk size 0 never reaches the head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# 0: full logits; 7: several chunks per micro-batch of the backend tests' random batches.
CHUNKS = (0, 7)


def chunked_vs_full(
    start: Callable[[int], Any],
    share_of: Callable[[Any], Any],
    train: Callable[[Any], dict],
    chunks: tuple[int, ...] = CHUNKS,
) -> dict:
    """``{chunk: ...}`` for each ``logprob_chunk_tokens`` in ``chunks``, each from a fresh model:
    the old log-probs of ``share_of(runtime)`` (``compute_logprobs``), the metrics of
    ``train(runtime)`` (one train step), and how many calls (and rows) the chunked head made.

    ``start(chunk)`` sets up a fresh :class:`posttrain.WorkerRuntime` whose strategy config has
    ``logprob_chunk_tokens=chunk``; the backend's worker module knows how to build it."""
    import posttrain.scoring.logprob_head as head

    original = head.chunked_token_logprobs
    rows: list[int] = []

    def counted(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    # logprob_head calls the head through its own module global: patching that counts every call.
    head.chunked_token_logprobs = counted
    out = {}
    try:
        for chunk in chunks:
            rows.clear()
            runtime = start(chunk)
            logprobs = runtime.compute_logprobs(share_of(runtime))
            metrics = train(runtime)
            out[chunk] = {
                "logprobs": logprobs,
                "metrics": metrics,
                "head_calls": len(rows),
                "head_rows": sum(rows),
            }
    finally:
        head.chunked_token_logprobs = original
    return out
