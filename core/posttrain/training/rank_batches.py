"""One rank's micro-batches for a train or scoring pass, as many on every data-parallel rank.

Collectives inside a forward or backward pass (FSDP's all-gathers, ZeRO's reductions) need every
rank to run as many passes as the busiest one: the count is agreed with an all-reduce, and a rank
with fewer rows runs filler micro-batches that score nothing. Trainer plugins that micro-batch an
HF model share these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from posttrain.backends.distributed import agree_max
from posttrain.backends.plumbing import rank_device
from posttrain.config.scoring_options import scoring_options
from posttrain.protocol import SequenceBatch
from posttrain.scoring.logprob_head import TokenLogprobs
from posttrain.scoring.modeling import shifted_entropy, shifted_token_logprobs, shifted_values
from posttrain.training.micro_batching import (
    fixed_micro_batches,
    length_sorted_micro_batches,
    token_budget_micro_batches,
)

if TYPE_CHECKING:
    from posttrain.launch.worker import WorkerContext

# A micro-batch's forward pass: logits, a value or score head's output, or the chunked
# head's TokenLogprobs.
Forward = Callable[[SequenceBatch], Any]


def micro_batch_size(worker: WorkerContext, train: bool, for_logprobs: bool) -> int:
    """Rows per micro-batch: the strategy config's ``micro_batch_size`` (when scoring,
    ``logprob_micro_batch_size`` first; see :class:`~posttrain.ScoringOptions`), else
    ``per_device_train_batch_size`` in a trainer and the role's ``infer_batch_size`` (or 8) in a
    scorer."""
    options = scoring_options(worker)
    rows = options.scoring_rows() if for_logprobs else options.micro_batch_size
    if not train:
        return rows or worker.infer_batch_size or 8
    return rows or worker.require_training_args().per_device_train_batch_size


def _token_budget(worker: WorkerContext) -> int | None:
    """The token budget of dynamic micro-batches (``use_dynamic_batch_size``), else None."""
    args = worker.training_args
    if args is None or not args.use_dynamic_batch_size:
        return None
    return args.max_tokens_per_micro_batch


def plan_micro_batches(
    worker: WorkerContext, batch: SequenceBatch, train: bool, for_logprobs: bool = False
) -> tuple[list[list[int]], int]:
    """This rank's micro-batches (row indices) and the number every rank will run (agreed over
    the default group); dynamic batching (a token budget) in trainers only."""
    budget = _token_budget(worker) if train else None
    if budget is not None:
        groups = token_budget_micro_batches(batch, budget)
    elif for_logprobs:  # results go back by row: rows of similar length share a pass
        groups = length_sorted_micro_batches(batch, micro_batch_size(worker, train, for_logprobs))
    else:
        groups = fixed_micro_batches(len(batch), micro_batch_size(worker, train, for_logprobs))
    count = agree_max(len(groups), rank_device(worker))
    if budget is not None and len(groups) < count <= len(batch):
        # Spread this rank's rows over as many micro-batches as the busiest rank runs.
        spread = token_budget_micro_batches(batch, budget, min_micro_batches=count)
        if len(spread) == count:
            groups = spread
    return groups, count


def filler_micro_batch(batch: SequenceBatch) -> SequenceBatch:
    """A one-row micro-batch that scores nothing (response_mask 0): keeps collectives in step."""
    if len(batch):
        mb = batch.select([0])
        tensors = dict(mb.tensors)
        tensors["attention_mask"] = torch.zeros_like(tensors["attention_mask"])
        tensors["attention_mask"][:, :2] = 1
        tensors["response_mask"] = torch.zeros_like(tensors["response_mask"])
        return SequenceBatch(tensors, dict(batch.meta)).trimmed()
    tensors = {
        k: torch.zeros((1, 2), dtype=v.dtype)
        if v.dim() == 2
        else torch.zeros((1, *v.shape[1:]), dtype=v.dtype)
        for k, v in batch.tensors.items()
    }
    tensors["attention_mask"] = torch.ones((1, 2), dtype=torch.long)
    return SequenceBatch(tensors, dict(batch.meta))


def to_device(batch: SequenceBatch, device: torch.device | str) -> SequenceBatch:
    return SequenceBatch(
        {k: v.to(device, non_blocking=True) for k, v in batch.tensors.items()}, dict(batch.meta)
    )


def micro_batches(
    batch: SequenceBatch, groups: list[list[int]], count: int, device: torch.device | str
) -> Iterator[tuple[list[int] | None, SequenceBatch]]:
    """``count`` micro-batches on ``device``: ``(row indices, rows)`` for this rank's real ones,
    then ``(None, filler)`` until every rank has run as many."""
    for i in range(count):
        real = i < len(groups)
        mb = batch.select(groups[i]).trimmed() if real else filler_micro_batch(batch)
        yield (groups[i] if real else None), to_device(mb, device)


def _loss_inputs(
    worker: WorkerContext,
    logits: torch.Tensor | TokenLogprobs,
    mb: SequenceBatch,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the loss takes from the model's output: values for a value head, else log-probs
    and entropy (computed from logits, or already computed by a chunked head)."""
    if worker.head == "value":
        return shifted_values(logits), None
    if isinstance(logits, TokenLogprobs):
        # The chunked head detached the entropy already when its gradient is not needed.
        return logits.logprobs, logits.entropy
    logprobs = shifted_token_logprobs(logits, mb.input_ids)
    if entropy_grad:
        return logprobs, shifted_entropy(logits)
    with torch.no_grad():
        return logprobs, shifted_entropy(logits.detach())


def accumulate_gradients(
    worker: WorkerContext,
    batch: SequenceBatch,
    forward: Forward,
    backward: Callable[[torch.Tensor], object],
    loss_fn: Callable[
        [torch.Tensor, torch.Tensor | None, SequenceBatch], tuple[torch.Tensor, dict[str, float]]
    ],
) -> dict[str, float]:
    """Forward ``forward(mb) -> logits`` (a value head's ``[B, T, 1]`` for a critic; or the
    :class:`~posttrain.scoring.logprob_head.TokenLogprobs` of ``logprob_forward``), the core's
    loss and ``backward(loss)`` over every micro-batch of this rank's plan (fillers with zero
    weight, so every rank runs as many); returns the real ones' summed loss metrics."""
    entropy_grad = bool(getattr(worker.algorithm, "entropy_coef", 0.0))
    groups, count = plan_micro_batches(worker, batch, train=True)
    metrics: dict[str, float] = {}
    for rows, mb in micro_batches(batch, groups, count, rank_device(worker)):
        logits = forward(mb)
        outputs, entropy = _loss_inputs(worker, logits, mb, entropy_grad)
        loss, mb_metrics = loss_fn(outputs, entropy, mb)
        if rows is None:
            loss = loss * 0.0
        backward(loss)
        del logits, outputs, entropy, loss
        if rows is not None:
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + float(value)
    return metrics


@torch.no_grad()
def score_tokens(
    batch: SequenceBatch,
    groups: list[list[int]],
    count: int,
    device: torch.device | str,
    forward: Forward,
    per_token: Callable[[Any, SequenceBatch], torch.Tensor],
) -> torch.Tensor:
    """``per_token(forward(mb), mb)`` of this rank's rows, masked by attention (float32, on the
    host, laid out as ``batch``)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows, mb in micro_batches(batch, groups, count, device):
        model_out = forward(mb)
        if rows is not None:
            values = per_token(model_out, mb) * mb.attention_mask
            index = torch.as_tensor(rows, dtype=torch.long)
            out[index, : values.shape[1]] = values.float().cpu()
        del model_out
    return out


def _token_logprobs(out: torch.Tensor | TokenLogprobs, mb: SequenceBatch) -> torch.Tensor:
    if isinstance(out, TokenLogprobs):
        return out.logprobs
    return shifted_token_logprobs(out, mb.input_ids)


def score_logprobs(
    batch: SequenceBatch,
    groups: list[list[int]],
    count: int,
    device: torch.device | str,
    forward: Forward,
) -> torch.Tensor:
    """Per-token log-probs of this rank's rows; ``forward(mb)`` returns logits (or
    :class:`~posttrain.scoring.logprob_head.TokenLogprobs`, see ``logprob_forward``)."""
    return score_tokens(batch, groups, count, device, forward, _token_logprobs)


def score_values(
    batch: SequenceBatch,
    groups: list[list[int]],
    count: int,
    device: torch.device | str,
    forward: Forward,
) -> torch.Tensor:
    """A critic's values of this rank's rows; ``forward(mb)`` returns the ``[B, T, 1]`` head."""
    return score_tokens(batch, groups, count, device, forward, lambda out, mb: shifted_values(out))


@torch.no_grad()
def score_sequences(
    batch: SequenceBatch,
    groups: list[list[int]],
    count: int,
    device: torch.device | str,
    forward: Forward,
) -> torch.Tensor:
    """One score per row of this rank's share (float32, host); ``forward(mb)`` returns them."""
    out = torch.zeros(len(batch), dtype=torch.float32)
    for rows, mb in micro_batches(batch, groups, count, device):
        scores = forward(mb)
        if rows is not None:
            out[torch.as_tensor(rows, dtype=torch.long)] = scores.float().cpu()
        del scores
    return out


@torch.no_grad()
def score_rows(
    worker: WorkerContext,
    batch: SequenceBatch,
    model: torch.nn.Module,
    score: Callable[
        [SequenceBatch, list[list[int]], int, torch.device | str, Forward], torch.Tensor
    ],
    forward: Forward,
    train: bool,
) -> torch.Tensor:
    """``score`` (:func:`score_logprobs`, :func:`score_values`, :func:`score_sequences`) of this
    rank's rows through ``forward(micro_batch)``, planned as a scoring pass of a trainer
    (``train``) or of an inference role, with ``model`` in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    try:
        groups, count = plan_micro_batches(worker, batch, train, for_logprobs=True)
        return score(batch, groups, count, rank_device(worker), forward)
    finally:
        model.train(was_training)
