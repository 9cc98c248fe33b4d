"""Megatron dist checkpoints of model + optimizer, loadable under another TP / PP / DP layout.

Model tensors are saved as sharded tensors with global names (megatron's ``sharded_state_dict``),
the distributed optimizer in the ``fully_reshardable`` format. Per-rank extras (step counters,
RNG states) go to ``extra_state_rank<r>.pt``.

The Adam step count is restored from the extras rather than trusted from the optimizer state:
without apex / TransformerEngine, megatron-core can load one ``step`` tensor shared by every
parameter, which then advances once per parameter per update (weights drift silently), and a
``fully_reshardable`` load may not carry ``step`` at all. Each parameter gets its own count.

With LoRA (``model_args.lora``) a checkpoint holds the adapters alone, with their optimizer
state, in a form no layout depends on (:func:`posttrain_megatron.lora.portable`), beside the
record of the base they adapt.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain.backend import (
    LORA_RECORD,
    check_lora_record,
    is_cuda,
    lora_args,
    lora_record,
    restore_rng_state,
    rng_state,
)
from posttrain_megatron import mcore_compat
from posttrain_megatron.lora import TRAIN, adapter_parameters, localised, portable
from posttrain_megatron.state import MegatronState
from posttrain_megatron.wrappers import inner_optimizers, unwrap

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from megatron.core.optimizer import MegatronOptimizer

    from posttrain import WorkerContext
    from posttrain.backend import FileDigests, HostBuffers

    # megatron's write buckets: (file name, storage key, (byte items, [(item, tensor)])).
    WriteBucket = tuple[str, str, tuple[list[Any], list[tuple[Any, torch.Tensor]]]]

_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_keys(models: list[torch.nn.Module]) -> list[str]:
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _sharded_state(
    models: list[torch.nn.Module], optimizer: MegatronOptimizer | None, is_loading: bool
) -> dict[str, Any]:
    # The bare GPTModels: tensor keys must not depend on the DDP / Float16Module wrappers, so
    # trainer checkpoints, infer models and `posttrain convert` output are interchangeable.
    state = {key: unwrap(m).sharded_state_dict() for key, m in zip(_model_keys(models), models)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=_SHARDING
        )
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _extra_path(path: str, rank: int) -> str:
    return os.path.join(path, f"extra_state_rank{rank}.pt")


def _write_extras(
    worker: WorkerContext, path: str, optimizer: MegatronOptimizer | None, digests: FileDigests
) -> dict[str, Any]:
    """Per-rank step counters and RNG states, and rank 0's layout file, hashed while written."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    layout = {**current_layout(), "has_optimizer": optimizer is not None}
    state = worker.engine_state(MegatronState)
    extra = {
        "step": state.step,
        "updates": state.updates,
        "layout": layout,
        **rng_state(worker),
        "rng_tracker": get_cuda_rng_tracker().get_states(),
    }
    with digests.open(_extra_path(path, _rank())) as f:
        torch.save(extra, f)
    if _rank() == 0:
        with digests.open(os.path.join(path, "megatron_layout.json")) as f:
            f.write(json.dumps({**layout, "strategy": worker.strategy_name}).encode())
    return layout


def _saved_optimizer(worker: WorkerContext) -> MegatronOptimizer | None:
    # A never-stepped optimizer has no state to shard (megatron asserts on it): model only.
    state = worker.engine_state(MegatronState)
    return state.optimizer if state.updates else None


def _make_target(path: str) -> str:
    target = os.path.join(path, "megatron")
    if _rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    return target


def save_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from posttrain.backend import FileDigests

    if lora_args(worker, TRAIN) is not None:
        return _save_adapters(worker, path)
    target = _make_target(path)
    optimizer = _saved_optimizer(worker)
    dist_checkpointing.save(_sharded_state(worker.model, optimizer, False), target)
    layout = _write_extras(worker, path, optimizer, FileDigests(path))
    dist.barrier()
    return layout


def begin_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any] | None:
    """megatron's async dist-checkpoint save, its writes run here: megatron plans the save
    (collective) and hands back the write buckets; their tensors are copied into reused host
    buffers (the only part the loop waits for) and a thread writes them, hashing each file.
    megatron's last step (gather of write results, ``.metadata``, ``metadata.json``) is
    collective: it runs on the main thread of every rank at the next train step once all ranks
    have written (:func:`advance_background_save`), or in :func:`finish_checkpoint`.

    None with LoRA: the runtime then saves synchronously (``save_checkpoint``: the adapters
    are a few MB, and that save leaves no background completion marker to wait for)."""
    from posttrain.backend import BackgroundSave, HostBuffers, write_threads

    if lora_args(worker, TRAIN) is not None:
        return None
    finish_checkpoint(worker, path)  # the driver waits first; a direct caller may not
    target = _make_target(path)
    optimizer = _saved_optimizer(worker)
    request = mcore_compat.async_dist_save(_sharded_state(worker.model, optimizer, False), target)
    buckets: list[WriteBucket] = []
    results_queue: Queue[Any] | None = None  # where megatron's finalisation reads results
    if request.async_fn is not None:  # None: nothing of the state is this rank's to write
        _, buckets, results_queue = request.async_fn_args
    state = worker.engine_state(MegatronState)
    buffers = state.checkpoint_buffers
    if buffers is None:
        buffers = HostBuffers(f"{worker.role} rank {_rank()}", pin=is_cuda(worker))
        state.checkpoint_buffers = buffers
    staged = _staged_buckets(buckets, buffers)
    save = BackgroundSave(path, _rank(), finalize_on_main=True)
    layout = _write_extras(worker, path, optimizer, save.digests)
    threads = write_threads(buffers.nbytes)
    save.start(lambda: _write_buckets(staged, save.digests, results_queue, threads))
    state.background_save = (save, request)
    return layout


def _bucket_key(item: Any) -> tuple[str, tuple[int, ...]]:
    return (item.index.fqn, tuple(item.index.offset or ()))


def _staged_buckets(buckets: list[WriteBucket], buffers: HostBuffers) -> list[WriteBucket]:
    """megatron's write buckets with every tensor replaced by its host buffer copy."""
    tensors = [(_bucket_key(item), t) for _, _, (_, data) in buckets for item, t in data]
    buffers.reserve(tensors)
    staged = [
        (name, key, (bytes_data, [(item, buffers.copy(_bucket_key(item), t)) for item, t in data]))
        for name, key, (bytes_data, data) in buckets
    ]
    buffers.synchronize()
    return staged


def _write_buckets(
    buckets: list[WriteBucket],
    digests: FileDigests,
    results_queue: Queue[Any] | None,
    threads: int = 1,
) -> None:
    """What megatron's forked writer does, on threads and hashing: each bucket is one file of
    DCP items (``threads`` written at once); the write results go where megatron's
    finalisation reads them."""
    from concurrent.futures import ThreadPoolExecutor

    write_item, lead, extra = mcore_compat.dcp_write_item()

    def write_file(bucket: WriteBucket) -> list[Any]:
        file_name, storage_key, (bytes_data, tensor_data) = bucket
        with digests.open(file_name) as stream:
            return [
                write_item(*lead, stream, data, item, storage_key, **extra)
                for item, data in [*bytes_data, *tensor_data]
            ]

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            results = dict(enumerate(pool.map(write_file, buckets)))
    except BaseException as exc:
        if results_queue is not None:
            results_queue.put(exc)  # megatron's finalisation then fails on every rank
        raise
    if results_queue is not None:
        results_queue.put(results)


def advance_background_save(worker: WorkerContext, block: bool = False) -> None:
    """Finish a background save whose files every rank has written: megatron's collective last
    step, then this rank's completion marker. Called by every rank at the same point (the start
    of a train step, or ``finish_checkpoint`` with ``block``); without ``block`` the ranks first
    agree, with one small all-reduce, that all of them are done writing."""
    state = worker.engine_state(MegatronState)
    pending = state.background_save
    if pending is None:
        return
    save, request = pending
    if block:
        save.wait_written()
    else:
        done = torch.tensor([1 if save.written() else 0], dtype=torch.int32)
        if is_cuda(worker):
            done = done.cuda()
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if not int(done.item()):
            return
    state.background_save = None
    for finalize in request.finalize_fns:
        finalize()
    save.complete()
    save.join()


def finish_checkpoint(worker: WorkerContext, path: str) -> bool:
    advance_background_save(worker, block=True)
    return True


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    from megatron.core import dist_checkpointing

    check_lora_record(worker, path, lora_args(worker, TRAIN))
    if lora_args(worker, TRAIN) is not None:
        return _load_adapters(worker, path)
    own = _extra_path(path, _rank())
    extra = torch.load(own if os.path.exists(own) else _extra_path(path, 0), weights_only=False)
    state = worker.engine_state(MegatronState)
    optimizer = state.optimizer
    if not extra["layout"].get("has_optimizer"):
        optimizer = None
    loaded = dist_checkpointing.load(
        _sharded_state(worker.model, optimizer, True), os.path.join(path, "megatron")
    )
    for key, model in zip(_model_keys(worker.model), worker.model):
        unwrap(model).load_state_dict(loaded[key])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        set_adam_steps(optimizer, extra["updates"])
    _restore_progress(worker, state, extra, own)
    return True


# --------------------------------------------------------------------------------------------
# LoRA: the adapters and their optimizer state alone (the base is model_name_or_path's)
# --------------------------------------------------------------------------------------------


def _stage_path(path: str, stage: int) -> str:
    return os.path.join(path, f"lora_stage{stage}.pt")


def _masters(
    optimizer: MegatronOptimizer,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.optim.Optimizer]]:
    """``(model parameter, the float32 parameter its optimizer steps, torch optimizer)`` of
    every parameter a megatron optimizer (chained or not, float16 or not) updates."""
    chained = getattr(optimizer, "chained_optimizers", None)
    out = []
    for part in chained if chained is not None else [optimizer]:
        inner = part.optimizer
        if hasattr(part, "float16_groups"):  # masters beside bf16 / fp16 parameters
            for model_group, master_group in zip(
                part.float16_groups, part.fp32_from_float16_groups
            ):
                out += [(p, m, inner) for p, m in zip(model_group, master_group)]
            out += [(p, p, inner) for group in part.fp32_from_fp32_groups for p in group]
        else:
            out += [(p, p, inner) for group in inner.param_groups for p in group["params"]]
    return out


def _save_adapters(worker: WorkerContext, path: str) -> dict[str, Any]:
    """The adapters, their float32 masters and Adam moments in a layout-free form
    (:func:`posttrain_megatron.lora.portable`): one file per pipeline stage, written by its
    first TP and DP rank; the extras of a full checkpoint; rank 0's record of the base and the
    adapters' shape (:func:`posttrain.backend.lora_record`)."""
    from megatron.core import parallel_state as ps

    from posttrain.backend import FileDigests

    if _rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    optimizer = _saved_optimizer(worker)
    params = adapter_parameters(worker.model)
    tensors: dict[str, dict[str, torch.Tensor]] = {n: {"param": p} for n, p in params.items()}
    names = {id(p): n for n, p in params.items()}
    for param, master, inner in _masters(optimizer) if optimizer is not None else []:
        entry = tensors[names[id(param)]]
        if master is not param:
            entry["master"] = master
        moments = inner.state.get(master, {})
        entry.update((k, moments[k]) for k in ("exp_avg", "exp_avg_sq") if k in moments)
    saved = portable(worker.model, tensors)  # collective over TP
    digests = FileDigests(path)
    writer = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    if writer:
        with digests.open(_stage_path(path, ps.get_pipeline_model_parallel_rank())) as f:
            torch.save(saved, f)
    layout = _write_extras(worker, path, optimizer, digests)
    if _rank() == 0:
        with digests.open(os.path.join(path, LORA_RECORD)) as f:
            f.write(json.dumps(lora_record(worker), sort_keys=True).encode())
    dist.barrier()
    return layout


def _load_adapters(worker: WorkerContext, path: str) -> bool:
    """What :func:`_save_adapters` wrote, in this run's layout (any TP / PP / DP)."""
    own = _extra_path(path, _rank())
    extra = torch.load(own if os.path.exists(own) else _extra_path(path, 0), weights_only=False)
    stages = extra["layout"]["pipeline_model_parallel_size"]
    saved: dict[str, Any] = {}
    for stage in range(stages):
        saved.update(torch.load(_stage_path(path, stage), weights_only=False))
    local = localised(worker.model, saved)
    params = adapter_parameters(worker.model)
    state = worker.engine_state(MegatronState)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local[name]["param"])
        names = {id(p): n for n, p in params.items()}
        optimizer = state.optimizer if extra["layout"].get("has_optimizer") else None
        for param, master, inner in _masters(optimizer) if optimizer is not None else []:
            entry = local[names[id(param)]]
            if master is not param:
                master.copy_(entry.get("master", entry["param"]))
            inner.state[master] = {
                "step": torch.tensor(0.0),  # set_adam_steps gives it the saved count
                "exp_avg": entry["exp_avg"].to(master.device, master.dtype),
                "exp_avg_sq": entry["exp_avg_sq"].to(master.device, master.dtype),
            }
        if optimizer is not None:
            set_adam_steps(optimizer, extra["updates"])
    _restore_progress(worker, state, extra, own)
    return True


def _restore_progress(
    worker: WorkerContext, state: MegatronState, extra: dict[str, Any], own: str
) -> None:
    """The step and update counts of a loaded checkpoint and, where it was saved in this
    layout (``own``: this rank's file exists), this rank's RNG streams; then every rank waits
    for the others' loads."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state.step = extra["step"]
    state.updates = extra["updates"]
    saved_layout = {k: v for k, v in extra["layout"].items() if k != "has_optimizer"}
    if saved_layout == current_layout() and os.path.exists(own):  # same layout: same RNG
        restore_rng_state(worker, extra)
        get_cuda_rng_tracker().set_states(extra["rng_tracker"])
    dist.barrier()


def current_layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "format": "megatron_dist",
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def set_adam_steps(optimizer: MegatronOptimizer, updates: int) -> None:
    """Give every parameter its own Adam step tensor equal to ``updates``."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = updates
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    # torch's fused Adam keeps the count on the parameter's device.
                    where = param.device if group.get("fused") else "cpu"
                    state["step"] = torch.tensor(float(updates), device=where)


def load_model_weights(models: list[torch.nn.Module], path: str) -> None:
    """Initial weights from a Megatron dist checkpoint (``posttrain convert`` writes one)."""
    from megatron.core import dist_checkpointing

    target = (
        os.path.join(path, "megatron") if os.path.isdir(os.path.join(path, "megatron")) else path
    )
    loaded = dist_checkpointing.load(_sharded_state(models, None, True), target)
    for key, model in zip(_model_keys(models), models):
        unwrap(model).load_state_dict(loaded[key])


def save_model_weights(models: list[torch.nn.Module], path: str) -> None:
    """A model-only dist checkpoint (what ``use_dist_checkpointing`` loads)."""
    from megatron.core import dist_checkpointing

    target = os.path.join(path, "megatron")
    if _rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(models, None, False), target)
    dist.barrier()
