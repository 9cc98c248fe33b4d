"""Training steps and log-prob scoring through megatron-core's forward-backward schedules.

Micro-batches go through ``get_forward_backward_func()``, so pipeline (1F1B) and interleaved
virtual-pipeline schedules work unchanged. A language-model head gives the loss log-probs and
entropy, a critic's value head (:mod:`posttrain_megatron.value_head`) values, both aligned as
``posttrain.scoring.modeling`` aligns them. Every rank of the role runs the same number of
micro-batches (agreed with an all-reduce); ranks with fewer run zero-weight fillers. Results
exist on the last pipeline stage and are broadcast to the other stages of its pipeline, since
the driver collects from the first rank of each data-parallel index.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain import PosttrainError, SequenceBatch
from posttrain.backend import (
    agree_max,
    fixed_micro_batches,
    rank_device,
    shifted_values,
    token_budget_micro_batches,
)
from posttrain_megatron import context_parallel, packing, routing, token_scores
from posttrain_megatron.checkpointing import advance_background_save
from posttrain_megatron.model_builder import TRAIN
from posttrain_megatron.state import MegatronState

if TYPE_CHECKING:
    from posttrain import WorkerContext

    # A micro-batch slot: its rows of the batch (None: a filler) and the trimmed micro-batch.
    MicroBatch = tuple[list[int] | None, SequenceBatch]
    # A micro-batch's loss and metrics, as megatron's schedule takes them from a loss function.
    LossResult = tuple[torch.Tensor, dict[str, float]]
    # loss_for(rows, micro_batch, outputs, entropy): outputs are log-probs or values.
    LossFor = Callable[
        [list[int] | None, SequenceBatch, torch.Tensor, torch.Tensor | None], LossResult
    ]
    # What a forward step hands megatron's schedule: the output and its loss function.
    ForwardOut = tuple[torch.Tensor, Callable[[torch.Tensor], LossResult]]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------------


def _rows_per_micro_batch(worker: WorkerContext, for_logprobs: bool) -> int:
    cfg = worker.config
    if worker.strategy_name != TRAIN:
        return cfg.scoring_rows() or worker.infer_batch_size or 8
    train_rows = cfg.micro_batch_size or worker.require_training_args().per_device_train_batch_size
    return (cfg.logprob_micro_batch_size or train_rows) if for_logprobs else train_rows


def plan(
    worker: WorkerContext, batch: SequenceBatch, for_logprobs: bool
) -> tuple[list[list[int]], int]:
    """This rank's micro-batches (row indices) and the count every rank runs."""
    args = worker.training_args
    dynamic = args is not None and args.use_dynamic_batch_size and worker.strategy_name == TRAIN
    budget = args.max_tokens_per_micro_batch if args is not None and dynamic else None
    if budget is not None:
        # Sequences of uneven length balanced into micro-batches under the token budget.
        groups = token_budget_micro_batches(batch, budget)
    else:
        groups = fixed_micro_batches(len(batch), _rows_per_micro_batch(worker, for_logprobs))
    count = agree_max(len(groups), rank_device(worker))
    vpp = worker.config.virtual_pipeline_model_parallel_size
    if vpp and vpp > 1:
        # The interleaved schedule runs micro-batches in groups of PP per virtual stage.
        pp = worker.config.pipeline_model_parallel_size
        count = math.ceil(count / pp) * pp
        if len(groups) < count <= len(batch) and not dynamic:
            groups = fixed_micro_batches(len(batch), math.ceil(len(batch) / count))
    if budget is not None and len(groups) < count <= len(batch):
        spread = token_budget_micro_batches(batch, budget, min_micro_batches=count)
        if len(spread) == count:
            groups = spread
    return groups, count


def _micro_batches(
    worker: WorkerContext, batch: SequenceBatch, groups: list[list[int]], count: int
) -> list[MicroBatch]:
    """(row indices or None for a filler, trimmed micro-batch) for each of ``count`` slots."""
    if not len(batch):
        raise ValueError("megatron: an empty batch cannot be scored")
    out: list[MicroBatch] = []
    for i in range(count):
        if i < len(groups):
            out.append((groups[i], batch.select(groups[i]).trimmed()))
        else:
            out.append((None, batch.select([0]).trimmed()))
    if _needs_equal_shapes(worker):
        out = _equal_shapes(worker, out)
    return out


def _needs_equal_shapes(worker: WorkerContext) -> bool:
    """The allgather MoE dispatcher gathers equal-sized token blocks over expert-parallel ranks."""
    cfg = worker.config
    return cfg.expert_model_parallel_size > 1 and cfg.moe_token_dispatcher_type == "allgather"


def _equal_shapes(worker: WorkerContext, items: list[MicroBatch]) -> list[MicroBatch]:
    """Pad every micro-batch to the largest rows x width of its slot on any rank; padding rows
    and columns are masked out (attention and response masks 0) and never returned."""
    sizes = torch.tensor(
        [[len(mb), mb.input_ids.shape[1]] for _, mb in items], device=rank_device(worker)
    )
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    padded: list[MicroBatch] = []
    for (rows, mb), (n, width) in zip(items, sizes.tolist()):
        tensors = {}
        for key, value in mb.tensors.items():
            if value.dim() == 2:
                value = torch.nn.functional.pad(value, (0, width - value.shape[1]))
            tensors[key] = torch.nn.functional.pad(
                value, (0, 0) * (value.dim() - 1) + (0, n - len(mb))
            )
        padded.append((rows, SequenceBatch(tensors, dict(mb.meta))))
    return padded


# --------------------------------------------------------------------------------------------
# Forward-backward
# --------------------------------------------------------------------------------------------


def _labels(worker: WorkerContext, next_tokens: torch.Tensor) -> torch.Tensor | None:
    """What the model is called with: next tokens for a language model (it then returns their
    scores, token_scores.install); none for a value head (it returns [b, s, 1] values)."""
    return None if worker.head == "value" else next_tokens


def _loss_inputs(
    worker: WorkerContext, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's per-position output [b, s, k] as the loss takes it: ``(values, None)`` for a
    value head, ``(logprobs, entropy)`` otherwise; ``out[:, t]`` belongs to ``input_ids[:, t]``."""
    if worker.head == "value":
        return shifted_values(out), None
    return token_scores.aligned(out)


def _run_schedule(
    worker: WorkerContext,
    items: list[MicroBatch],
    loss_for: LossFor,
    forward_only: bool,
    routed: routing.Routing | None = None,
) -> list[Any]:
    """One forward(-backward) schedule over ``items``; ``routed`` replays or records the MoE
    routers' choices in its forward passes (and recomputes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    models = worker.model
    dev = rank_device(worker)
    cfg = worker.config
    cp = cfg.context_parallel_size
    # Sequence parallelism splits the sequence over TP ranks, context parallelism into 2 x CP
    # chunks over CP ranks: pad it to a multiple of both.
    multiple = (cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1) * (
        2 * cp if cp > 1 else 1
    )

    slots = {id(mb): slot for slot, (_, mb) in enumerate(items)}

    def routers(mb: SequenceBatch, width: int, packed: packing.Packed | None = None) -> Any:
        """Around the model's forward: the routers replay or record ``mb``'s routing."""
        if routed is None:
            return contextlib.nullcontext()
        positions = routing.token_positions(worker, len(mb), width, packed)
        return routed.forward(slots[id(mb)], mb, positions, width)

    def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module) -> ForwardOut:
        rows, mb = next(data_iterator)
        ids = mb.input_ids.to(dev)
        width = ids.shape[1]
        if cfg.pack_sequences:
            return _packed_forward(worker, model, rows, mb, ids, multiple, loss_for, routers)
        padded = torch.nn.functional.pad(ids, (0, -width % multiple))
        layout = padded.shape[1]
        positions = torch.arange(padded.shape[1], device=dev).unsqueeze(0).expand_as(padded)
        next_tokens = torch.nn.functional.pad(padded[:, 1:], (0, 1), value=token_scores.NO_TARGET)
        if cp > 1:  # this rank's chunks of the sequence (targets taken before the split)
            rank = ps.get_context_parallel_rank()
            padded, positions, next_tokens = (
                context_parallel.split_for_rank(t, 1, cp, rank)
                for t in (padded, positions, next_tokens)
            )
        # Right-padded rows under causal attention: padding never reaches a real token.
        with routers(mb, layout):
            output = model(
                input_ids=padded,
                position_ids=positions,
                attention_mask=None,
                labels=_labels(worker, next_tokens),
            )

        def loss_func(scores: torch.Tensor) -> LossResult:
            if cp > 1:  # the whole sequence on every CP rank: the loss sees whole rows
                scores = context_parallel.gather_sequence(
                    scores, 1, ps.get_context_parallel_group()
                )
            return loss_for(rows, mb.with_tensors(), *_loss_inputs(worker, scores[:, :width]))

        return output, loss_func

    # One iterator per model chunk: each chunk's forward pulls the same micro-batch sequence.
    iterators = [iter(items) for _ in models]
    with routed.installed() if routed is not None else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(items),
            seq_length=max(mb.input_ids.shape[1] for _, mb in items),
            micro_batch_size=max(len(mb) for _, mb in items),
            forward_only=forward_only,
        )


def _packed_forward(
    worker: WorkerContext,
    model: torch.nn.Module,
    rows: list[int] | None,
    mb: SequenceBatch,
    ids: torch.Tensor,
    multiple: int,
    loss_for: LossFor,
    routers: Callable[[SequenceBatch, int, packing.Packed], Any],
) -> ForwardOut:
    """forward_step on one packed row (pack_sequences); results back in the padded layout."""
    packed = packing.pack(ids, mb.attention_mask.to(ids.device), multiple)
    with routers(mb, ids.shape[1], packed):
        output = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            labels=_labels(worker, packed.labels),
            packed_seq_params=packed.params,
        )

    def loss_func(scores: torch.Tensor) -> LossResult:
        unpacked = packing.unpack(packed, scores)
        return loss_for(rows, mb.with_tensors(), *_loss_inputs(worker, unpacked))

    return output, loss_func


def _from_last_stage(obj: Any) -> Any:
    """``obj`` as the last pipeline stage of this rank's pipeline has it."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    dist.broadcast_object_list(
        box,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return box[0]


def train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
) -> dict[str, float]:
    # Every rank is here at once: the point to complete a background checkpoint save whose
    # files are all written (megatron's last step of a save is collective).
    advance_background_save(worker)
    models = worker.model
    state = worker.engine_state(MegatronState)
    optimizer, lr_multiplier = state.optimizer, state.lr_multiplier
    if optimizer is None or lr_multiplier is None:
        raise PosttrainError(
            f"megatron: role {worker.role} ({worker.strategy_name}) does not train"
        )
    cp = worker.config.context_parallel_size
    entropy_grad = bool(getattr(worker.algorithm, "entropy_coef", 0.0))
    routed = None
    if routing.wants(worker, models) and routing.update_replays(worker):
        if routing.mode(worker) == "old_policy":
            batch = state.old_routing.attach(batch, rank_device(worker))
        # Kept for the backward pass: recomputed layers replay their micro-batch again.
        routed = routing.Routing(worker, models, routing.REPLAY, backward=True)
    groups, count = plan(worker, batch, for_logprobs=False)
    items = _micro_batches(worker, batch, groups, count)

    def loss_for(
        rows: list[int] | None,
        mb: SequenceBatch,
        outputs: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> LossResult:
        # outputs: log-probs, or a critic's values (entropy None)
        mb = SequenceBatch({k: v.to(outputs.device) for k, v in mb.tensors.items()}, dict(mb.meta))
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()  # a metric only
        loss, metrics = loss_fn(outputs, entropy, mb)
        if rows is None:
            loss, metrics = loss * 0.0, {}
        # The schedule divides each micro-batch's loss by the micro-batch count and multiplies it
        # by the CP size; core's loss is already this micro-batch's share of the step, so undo
        # both. (Under CP every CP rank computes this same loss on the gathered sequence; the
        # gather's backward sums their gradients, which DDP's average over DP x CP divides.)
        return loss * count / cp, {k: float(v) for k, v in metrics.items()}

    for model in models:
        model.train()
        model.zero_grad_buffer()
    optimizer.zero_grad()
    step = state.step
    lr = worker.require_training_args().learning_rate * lr_multiplier(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    reduced = _run_schedule(worker, items, loss_for, forward_only=False, routed=routed)
    updated, grad_norm, _ = optimizer.step()
    # Megatron's float16 optimizer keeps float32 copies of the gradients on its master weights
    # until its next zero_grad: 4 bytes a parameter (5.8 GiB at 1.5B) that would stay through
    # the rollout and the scoring of the next step on a colocated GPU.
    optimizer.zero_grad()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if updated:
        state.updates += 1
    else:
        log.warning("megatron: step %d skipped (grad norm %s)", step, grad_norm)
    state.step = step + 1

    metrics: dict[str, float] = {}
    for entry in reduced or ():
        for key, value in entry.items():
            metrics[key] = metrics.get(key, 0.0) + value
    metrics = _from_last_stage(metrics)
    prefix = worker.metric_prefix
    metrics[f"{prefix}/grad_norm"] = grad_norm if math.isfinite(grad_norm) else float("nan")
    metrics[f"{prefix}/lr"] = lr
    return metrics


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    if worker.head != "lm":
        raise ValueError(f"megatron: role {worker.role} has a {worker.head} head, no log-probs")
    return _per_token(worker, batch)


def compute_values(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    if worker.head != "value":
        raise ValueError(f"megatron: role {worker.role} has a {worker.head} head, no values")
    return _per_token(worker, batch)


@torch.no_grad()
def _per_token(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    """The head's per-token output for every row (log-probs or values), 0 outside attention."""
    groups, count = plan(worker, batch, for_logprobs=True)
    items = _micro_batches(worker, batch, groups, count)
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)

    def loss_for(
        rows: list[int] | None,
        mb: SequenceBatch,
        outputs: torch.Tensor,
        _entropy: torch.Tensor | None,
    ) -> LossResult:
        if rows is not None:
            kept = (outputs * mb.attention_mask.to(outputs.device))[: len(rows)]
            width = min(kept.shape[1], out.shape[1])
            out[torch.as_tensor(rows, dtype=torch.long), :width] = kept[:, :width].float().cpu()
        return outputs.new_zeros(()), {}

    routed = _scoring_routing(worker)
    for model in worker.model:
        model.eval()
    _run_schedule(worker, items, loss_for, forward_only=True, routed=routed)
    if routed is not None and routed.mode == routing.RECORD:
        _keep_old_policy(worker, items, routed)
    for model in worker.model:
        model.train(worker.strategy_name == TRAIN)
    return _broadcast_tensor_from_last_stage(out, worker)


def _scoring_routing(worker: WorkerContext) -> routing.Routing | None:
    """A log-prob pass under routing replay: ``rollout`` replays the batch's routing (the
    trainer's old-policy pass, a megatron reference with experts); ``old_policy`` records the
    trainer's own pass for its update; else the routers choose."""
    models = worker.model
    if not routing.wants(worker, models):
        return None
    current = routing.mode(worker)
    if current == "rollout":
        return routing.Routing(worker, models, routing.REPLAY, backward=False)
    if current == "old_policy" and worker.strategy_name == TRAIN:
        return routing.Routing(worker, models, routing.RECORD, backward=False)
    return None


def _keep_old_policy(
    worker: WorkerContext, items: list[MicroBatch], routed: routing.Routing
) -> None:
    """The old-policy pass's routing, whole (every shard and stage), by row until the update."""
    old = worker.engine_state(MegatronState).old_routing
    old.rows = {}
    slots = [slot for slot, (rows, _) in enumerate(items) if rows is not None]
    whole = routing.gather_records([routed.records[s] for s in slots], rank_device(worker))
    experts = routing.experts_of(worker.model)
    for slot, recorded in zip(slots, whole):
        rows, mb = items[slot]
        width = recorded.shape[0] // len(mb)
        routing.keep_old_policy(old, mb, len(rows or ()), width, recorded, experts)


def _broadcast_tensor_from_last_stage(tensor: torch.Tensor, worker: WorkerContext) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    moved = tensor.to(rank_device(worker))
    dist.broadcast(
        moved,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return moved.cpu()
