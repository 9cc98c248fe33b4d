"""Engine of ``ddp_train``: an HF causal LM replicated on every rank, its gradients all-reduced by
torch DistributedDataParallel. Written against the public faces only (``posttrain``,
``posttrain.backend``); docs/plugin-guide.md walks through it."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from posttrain import SequenceBatch, WeightBucket, bucketize
from posttrain.backend import (
    accumulate_gradients,
    adamw,
    enable_gradient_checkpointing,
    end_process_group,
    export_dtype,
    export_streamed,
    init_default_process_group,
    is_cuda,
    is_rank0,
    load_model_with_head,
    logprob_forward,
    lr_lambda,
    memory_tags,
    move_optimizer_state,
    rank_device,
    restore_rng_state,
    rng_state,
    save_tokenizer_beside,
    score_logprobs,
    score_rows,
    settle_cuda,
    torch_dtype,
)

if TYPE_CHECKING:
    from posttrain import WorkerContext

log = logging.getLogger(__name__)


@attrs.define(kw_only=True)
class DDPState:
    """A rank's engine objects between calls: ``worker.engine_state(DDPState)``."""

    model: DistributedDataParallel | None = None  # None before load_model and while released
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    step: int = 0  # optimizer steps taken, saved in checkpoints


def _state(worker: WorkerContext) -> DDPState:
    return worker.engine_state(DDPState)


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    # gloo on a CPU, NCCL on a GPU; a group another role of these processes made is kept.
    init_default_process_group(worker.device)
    return {"dp_rank": dist.get_rank(), "dp_size": dist.get_world_size()}


def _wrap(worker: WorkerContext, module: torch.nn.Module) -> DistributedDataParallel:
    # broadcast_buffers=False: an HF model's buffers (rotary frequencies) are constants, and a
    # broadcast before every forward would make scoring collective too.
    ids = [rank_device(worker).index] if is_cuda(worker) else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def load_model(worker: WorkerContext) -> torch.nn.Module:
    state = _state(worker)
    args = worker.require_training_args()
    # fp32 master weights whatever model_args.dtype says: bf16 weights would round away updates
    # smaller than their last bit. The forward runs in model_args.dtype (_autocast).
    fp32 = attrs.evolve(worker.model_args, dtype="fp32")
    module = load_model_with_head(fp32, worker.head, worker.base_dir, rank_device(worker))
    if not worker.model_args.disable_gradient_checkpointing:
        enable_gradient_checkpointing(module)
    module.train()
    state.model = _wrap(worker, module)
    state.optimizer = adamw(module.parameters(), args)
    # Warmup and decay of training_args, as every built-in trainer schedules them.
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(args))
    state.step = 0
    return module  # worker.model: the HF model itself (the wrapper is state.model)


def _autocast(worker: WorkerContext) -> contextlib.AbstractContextManager[Any]:
    if worker.model_args.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(rank_device(worker).type, dtype=torch_dtype(worker.model_args.dtype))


def _forward(worker: WorkerContext, model: Any, hf_model: Any, train: bool) -> Callable[..., Any]:
    """The micro-batch forward of logprob_forward (chunked log-probs when the config asks),
    in model_args.dtype; ``hf_model`` is the HF model inside ``model``, whose head it swaps."""
    forward = logprob_forward(worker, model, train=train, hf_model=hf_model)

    def in_dtype(micro_batch: SequenceBatch) -> Any:
        with _autocast(worker):
            return forward(micro_batch)

    return in_dtype


def train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
) -> dict[str, float]:
    state = _state(worker)
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    if model is None or optimizer is None or scheduler is None:
        raise RuntimeError("ddp_train: train_step before load_model or while released")
    model.train()
    # Through the DDP wrapper: each backward all-reduces (averages) the gradients over ranks.
    metrics = accumulate_gradients(
        worker,
        batch,
        forward=_forward(worker, model, model.module, train=True),
        backward=lambda loss: loss.backward(),
        loss_fn=loss_fn,
    )
    max_norm = worker.require_training_args().max_grad_norm or math.inf  # 0: no clipping
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    lr = float(scheduler.get_last_lr()[0])  # the rate this step used
    if math.isfinite(grad_norm):
        optimizer.step()
    else:  # one bad batch must not turn every weight into NaN
        log.warning("ddp_train: grad norm %s at step %d: update skipped", grad_norm, state.step)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    state.step += 1
    metrics[f"{worker.metric_prefix}/grad_norm"] = grad_norm
    metrics[f"{worker.metric_prefix}/lr"] = lr
    return metrics


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    # The bare HF model: scoring needs no gradient, so no DDP and no collective.
    forward = _forward(worker, worker.model, worker.model, train=False)
    return score_rows(worker, batch, worker.model, score_logprobs, forward, train=True)


def _named(worker: WorkerContext, keep: bool, device: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of every weight in the export dtype on ``device``; with ``keep``
    False, a meta tensor of the same shape (the same buckets, no copy)."""
    dtype = export_dtype(worker)
    for name, value in worker.model.state_dict().items():
        if not keep:
            yield name, torch.empty(value.shape, dtype=dtype, device="meta")
        else:
            yield name, value.detach().to(device=device, dtype=dtype, copy=device == "cpu")


def export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool = False
) -> Iterator[WeightBucket]:
    """Every rank holds every weight: on the device each yields them all (a replica); through
    the host rank 0 copies them and the others yield as many empty buckets."""
    keep = on_device or is_rank0()
    device = rank_device(worker) if on_device else "cpu"
    for bucket in bucketize(_named(worker, keep, device), bucket_bytes):
        yield bucket if keep else WeightBucket()


def export_hf(worker: WorkerContext, path: str) -> bool:
    def write_config(out: str) -> None:
        config = copy.deepcopy(worker.model.config)
        config.dtype = export_dtype(worker)  # the written weights' dtype, not the fp32 master's
        config.save_pretrained(out)
        save_tokenizer_beside(worker, out, log)

    export_streamed(_named(worker, is_rank0(), "cpu"), path, write_config)  # rank 0 writes
    return True


def save_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any]:
    state = _state(worker)
    os.makedirs(path, exist_ok=True)
    rank = dist.get_rank()
    if rank == 0:  # replicas: one copy of the weights and optimizer is the whole state
        if state.optimizer is None or state.scheduler is None:
            raise RuntimeError("ddp_train: save_checkpoint before load_model")
        training = {
            "model": worker.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "step": state.step,
        }
        torch.save(training, os.path.join(path, "training.pt"))
    # Each rank's random state (dropout, sampling in a loss): a resume repeats its draws.
    torch.save(rng_state(worker), os.path.join(path, f"rng_rank{rank}.pt"))
    dist.barrier()  # every file written before the driver hashes the directory
    return {"format": "ddp_torch_save", "world_size": dist.get_world_size()}


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    state = _state(worker)
    if state.optimizer is None or state.scheduler is None:
        raise RuntimeError("ddp_train: load_checkpoint before load_model")
    saved = torch.load(os.path.join(path, "training.pt"), map_location="cpu", weights_only=True)
    worker.model.load_state_dict(saved["model"])  # copied into the rank's device tensors
    state.optimizer.load_state_dict(saved["optimizer"])  # moved to the parameters' device
    state.scheduler.load_state_dict(saved["scheduler"])
    state.step = saved["step"]
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng):  # a rank the saving run did not have keeps its own seed
        restore_rng_state(worker, torch.load(rng, weights_only=True))
    return True


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if not is_cuda(worker):
        return True  # host memory: nothing another role on these devices would gain
    state = _state(worker)
    wanted = memory_tags(tags)
    if wanted & {"weights", "grads"} and state.model is not None:
        # Dropped, not moved: DDP's reducer holds gradient-sized buckets on the GPU.
        state.model = None
        worker.model.zero_grad(set_to_none=True)
        worker.model.cpu()
    if "optimizer" in wanted:
        move_optimizer_state([state.optimizer], "cpu")
    settle_cuda(empty_cache=True)  # freed before the other role allocates
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if not is_cuda(worker):
        return True
    state = _state(worker)
    wanted = memory_tags(tags)
    if wanted & {"weights", "grads"} and state.model is None:
        # A new wrapper (collective: every rank resumes) over the same parameters.
        state.model = _wrap(worker, worker.model.to(rank_device(worker)))
    if "optimizer" in wanted:
        move_optimizer_state([state.optimizer], rank_device(worker))
    settle_cuda()
    return True


def shutdown_worker(worker: WorkerContext) -> bool:
    worker.state.pop(DDPState, None)
    worker.model = None
    end_process_group()  # a barrier, then the default group destroyed
    return True
