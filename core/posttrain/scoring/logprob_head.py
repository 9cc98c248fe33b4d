"""Token log-probs of an HF causal LM through its own forward call, chunked at the output head.

Wrappers gather the head's weight only inside the model's forward (FSDP2's root unit, ZeRO-3's
module hooks), so the model is called as usual and only its output embedding's ``forward`` is
swapped for the duration of the call: given the final hidden states it returns per-token
log-probs and entropy (:func:`~posttrain.scoring.chunked_logprobs.chunked_token_logprobs`), never
the ``[B, T, vocab]`` logits. The model's ``logits`` output then carries ``[B, T, 2]``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from posttrain.config.scoring_options import scoring_options
from posttrain.scoring.chunked_logprobs import chunked_token_logprobs

if TYPE_CHECKING:
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import SequenceBatch

log = logging.getLogger(__name__)

# Config attributes of architectures whose causal LM transforms the head's output (Gemma's
# soft-capping, Cohere's and Granite's scaling): a swapped head would skip that transform.
_SOFTCAP = ("final_logit_softcapping",)
_SCALES = ("logit_scale", "logits_scaling")


class TokenLogprobs(NamedTuple):
    """A micro-batch's per-token log-probs and entropy, float32 ``[B, T]``, aligned like
    :func:`~posttrain.scoring.modeling.shifted_token_logprobs` (``[:, t]`` scores
    ``input_ids[:, t]``); 0 at column 0 and where ``attention_mask`` is 0."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


def chunkable(model: Any) -> bool:
    """Whether ``model`` (an HF causal LM, peft-wrapped or not) returns its output embedding's
    result unchanged as its logits, from a plain linear head (a LoRA-adapted head is not)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear):
        return False
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) is not None for name in _SOFTCAP):
        return False
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in _SCALES)


def _head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    grad: bool,
) -> torch.Tensor:
    """``[B, T, 2]`` (log-prob, entropy) from ``[B, T, H]`` hidden states: row ``t`` of
    ``hidden`` scores ``input_ids[:, t + 1]``, computed only where that token is attended."""
    batch, length = input_ids.shape
    if tuple(hidden.shape[:2]) != (batch, length):
        raise RuntimeError(
            f"chunked log-probs: the output head got hidden states of shape "
            f"{tuple(hidden.shape)} for input_ids of shape {(batch, length)} (logits_to_keep?)"
        )
    pos = attention_mask[:, 1:].bool().nonzero()
    rows = pos[:, 0] * length + pos[:, 1]  # flat index of the hidden state that scores...
    targets = input_ids[pos[:, 0], pos[:, 1] + 1]  # ...this token
    h = hidden.reshape(batch * length, -1).index_select(0, rows)
    logp, entropy = chunked_token_logprobs(
        h, head.weight, head.bias, targets, chunk_tokens, with_entropy=with_entropy
    )
    if not grad:
        # Its gradient would arrive as zeros through the stack below: detached, it arrives as
        # None and backward skips the entropy term.
        entropy = entropy.detach()
    values = torch.stack((logp, entropy), dim=-1)
    # Out of place and not a view: FSDP2 hooks the root's output for backward.
    return values.new_zeros((batch, length, 2)).index_put((pos[:, 0], pos[:, 1] + 1), values)


@contextlib.contextmanager
def _swapped_forward(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """``module.forward`` is ``forward`` meanwhile; ``module(...)`` still runs every hook."""
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def forward_token_logprobs(
    model: Any,
    micro_batch: SequenceBatch,
    chunk_tokens: int,
    *,
    hf_model: Any = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> TokenLogprobs:
    """Call ``model`` (the HF model or a wrapper around it, e.g. a DeepSpeed engine) on the
    micro-batch with ``hf_model``'s output head (default: ``model``'s) computing log-probs
    ``chunk_tokens`` tokens at a time. Without ``with_entropy`` the entropy is zeros; without
    ``entropy_grad`` it carries no gradient."""
    from posttrain.backends.plumbing import model_inputs

    head = (hf_model if hf_model is not None else model).get_output_embeddings()
    produced: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        ids, mask = micro_batch.input_ids, micro_batch.attention_mask
        out = _head_logprobs(hidden, head, ids, mask, chunk_tokens, with_entropy, entropy_grad)
        produced.append(out)
        return out

    with _swapped_forward(head, forward):
        out = model(
            **model_inputs(model, micro_batch),
            attention_mask=micro_batch.attention_mask,
            use_cache=False,
        )
    logits = out.logits
    # Wrappers may re-wrap the output (ZeRO-3 detaches it into a hook) but keep its storage; a
    # model that computed anything from the head's output would not.
    if (
        len(produced) != 1
        or logits.shape != produced[0].shape
        or logits.data_ptr() != produced[0].data_ptr()
    ):
        raise RuntimeError(
            f"chunked log-probs: {type(head).__name__} output of "
            f"{type(hf_model or model).__name__} is not the model's logits as they are; set "
            "the role's strategy_config.logprob_chunk_tokens: 0"
        )
    return TokenLogprobs(logits[..., 0], logits[..., 1])


def logprob_forward(
    worker: WorkerContext,
    model: Any,
    *,
    train: bool,
    hf_model: Any = None,
    logits_forward: Callable[[SequenceBatch], torch.Tensor] | None = None,
) -> Callable[[SequenceBatch], Any]:
    """``forward(micro_batch)`` for :func:`~posttrain.training.rank_batches.accumulate_gradients`
    (``train``) or :func:`~posttrain.training.rank_batches.score_logprobs`.

    With the role's ``strategy_config.logprob_chunk_tokens`` > 0 (a
    :class:`~posttrain.config.scoring_options.ScoringOptions`), an LM head and a model whose
    head's output is its logits (:func:`chunkable`), it returns :class:`TokenLogprobs` computed
    through the chunked head (entropy and its gradient only when training needs them); else
    ``logits_forward(micro_batch)`` (default: the model's logits), as before.
    """
    from posttrain.backends.plumbing import forward_logits, log_once

    full = logits_forward or (lambda mb: forward_logits(model, mb))
    chunk = scoring_options(worker).logprob_chunk_tokens
    if chunk <= 0 or worker.head != "lm":
        return full
    target = hf_model if hf_model is not None else model
    if not chunkable(target):
        log_once(
            log,
            f"role {worker.role}: {type(target).__name__} transforms its logits or has no plain "
            "linear output head: log-probs from full logits (logprob_chunk_tokens unused)",
            logging.INFO,
        )
        return full
    entropy_grad = train and bool(getattr(worker.algorithm, "entropy_coef", 0.0))

    def forward(mb: SequenceBatch) -> TokenLogprobs:
        return forward_token_logprobs(
            model, mb, chunk, hf_model=hf_model, with_entropy=train, entropy_grad=entropy_grad
        )

    return forward
