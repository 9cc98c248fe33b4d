"""Engine side of ``fsdp2_train`` / ``fsdp2_infer``: an HF causal LM sharded with FSDP2.

Every decoder layer is its own ``fully_shard`` unit and the root holds the rest (embeddings, final
norm, LM head: tied embeddings stay one parameter in one unit). Parameter names stay HF names,
since ``fully_shard`` swaps module classes in place and HF gradient checkpointing wraps no module.

Collectives (all-gathers in forward, ``full_tensor``, DCP) need every rank to make the same calls
in the same order: micro-batch counts are agreed on with an all-reduce before a step, and ranks
with fewer micro-batches run zero-weight ones.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from posttrain import PosttrainError, SequenceBatch, WeightBucket, bucketize
from posttrain.backend import (
    LORA_RECORD,
    HashingStream,
    OldPolicyRouting,
    accumulate_gradients,
    adamw,
    adapter_sync,
    adapter_wire_name,
    check_lora_record,
    collective_timeout_s,
    enable_gradient_checkpointing,
    end_process_group,
    export_dtype,
    export_streamed,
    forward_logits,
    init_default_process_group,
    is_cuda,
    is_lora_adapter_entry,
    is_rank0,
    load_model_with_head,
    log_once,
    logprob_forward,
    lora_adapter_keys,
    lora_args,
    lora_base_model,
    lora_layers,
    lora_plain_name,
    lora_record,
    lr_lambda,
    memory_tags,
    merge_lora_weight,
    move_optimizer_state,
    rank_device,
    restore_rng_state,
    rng_state,
    save_tokenizer_beside,
    score_logprobs,
    score_rows,
    score_sequences,
    score_values,
    scoring_forward,
    sequence_scores,
    settle_cuda,
    torch_dtype,
    update_forward,
    write_lora_adapter,
)
from posttrain_fsdp import lora

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain import WorkerContext
    from posttrain.backend import BackgroundSave, FileDigests, HostBuffers

log = logging.getLogger(__name__)

TRAIN = "fsdp2_train"
# Wrapper segments other tools insert into parameter names; HF names have none of them.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


@attrs.define(kw_only=True)
class FSDPState:
    """This role's engine objects between calls (``worker.engine_state(FSDPState)``)."""

    mesh: DeviceMesh | None = None
    # A LoRA reference's lending actor, whose model (adapters disabled) it scores with.
    lender: WorkerContext | None = None
    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # Background checkpoint saves: the reused host copies, the gloo group their writes run
    # over, and the save in flight.
    checkpoint_buffers: HostBuffers | None = None
    checkpoint_group: dist.ProcessGroup | None = None
    background_save: BackgroundSave | None = None
    # routing_replay: old_policy: the old-policy pass's routing, until the update replays it.
    old_routing: OldPolicyRouting = attrs.field(factory=OldPolicyRouting)


# --------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh

    init_default_process_group(worker.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    worker.engine_state(FSDPState).mesh = init_device_mesh(
        "cuda" if is_cuda(worker) else "cpu", (world,), mesh_dim_names=("dp",)
    )
    return {"dp_rank": rank, "dp_size": world}


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules HF says must not be split across devices (decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # no hint: every block of the first ModuleList
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                return list(module)
    return layers


def _shard(
    worker: WorkerContext,
    model: torch.nn.Module,
    param_dtype: str | None,
    reduce_dtype: str | None,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> None:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(param_dtype) if param_dtype else None,
        reduce_dtype=torch_dtype(reduce_dtype) if reduce_dtype else None,
    )
    # cpu_offload on a CPU device has nothing to move (load_model passes False there).
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    kwargs = {
        "mesh": worker.engine_state(FSDPState).mesh,
        "mp_policy": mp,
        "offload_policy": offload,
    }
    for layer in _decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def load_model(worker: WorkerContext) -> torch.nn.Module:
    state = worker.engine_state(FSDPState)
    actor = lora.lender(worker)
    if actor is not None:
        # The reference of a LoRA actor is its base: the actor's model with adapters disabled
        # (compute_logprobs), not a second copy.
        log.info(
            "fsdp: %s uses %s's model with its LoRA adapters disabled", worker.role, actor.role
        )
        state.lender = actor
        state.step = 0
        return actor.model
    cfg = worker.config
    train = worker.strategy_name == TRAIN
    model_args = worker.model_args
    if train:  # float32 master weights; the forward runs in param_dtype
        model_args = attrs.evolve(model_args, dtype="fp32")
    # Loaded on the host; fully_shard moves each rank's shard to the mesh's device.
    model = load_model_with_head(model_args, worker.head, worker.base_dir, "cpu")
    if train and not worker.model_args.disable_gradient_checkpointing:
        enable_gradient_checkpointing(model)
    vision = getattr(getattr(model, "model", None), "visual", None)
    if train and vision is not None and worker.model_args.freeze_vision:
        # Frozen before the optimizer is built: the tower's weights take no optimizer state.
        vision.requires_grad_(False)
    if lora_args(worker, TRAIN) is not None:  # before fully_shard: adapters shard with the layers
        model = lora.wrap(worker, model)
    param_dtype = cfg.param_dtype or worker.model_args.dtype
    if param_dtype == model_args.dtype:
        param_dtype = None  # no cast needed
    reduce_dtype = getattr(cfg, "reduce_dtype", None)
    offload = getattr(cfg, "cpu_offload", False) and is_cuda(worker)
    if dist.get_world_size() == 1 and param_dtype is None and not offload:
        # Nothing to shard, cast or offload: a plain module skips FSDP's hooks and DTensor
        # dispatch (a third of a small model's step on CPU); checkpoints, export and memory
        # release take plain tensors as they take DTensors.
        model.to(rank_device(worker))
    else:
        _shard(worker, model, param_dtype, reduce_dtype, cfg.reshard_after_forward, offload)
    if train:
        _build_optimizer(worker, model)
        model.train()
    else:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    state.step = 0
    return model


def _build_optimizer(worker: WorkerContext, model: torch.nn.Module) -> None:
    args = worker.require_training_args()
    state = worker.engine_state(FSDPState)
    state.optimizer = adamw((p for p in model.parameters() if p.requires_grad), args)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(args))


# --------------------------------------------------------------------------------------------
# Training and scoring
# --------------------------------------------------------------------------------------------


def train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
) -> dict[str, float]:
    model = worker.model
    state = worker.engine_state(FSDPState)
    optimizer, scheduler = state.optimizer, state.scheduler
    if optimizer is None or scheduler is None:
        raise PosttrainError(f"fsdp: role {worker.role} ({worker.strategy_name}) does not train")
    model.train()
    forward = logprob_forward(worker, model, train=True)
    device = rank_device(worker)
    # Open through the backward passes: checkpointed layers replay the routing again.
    moe: dict[str, float] = {}  # how the rollout's routing compares with ours, when replayed
    with update_forward(worker, model, batch, forward, state.old_routing, device, moe) as (
        batch,
        forward,
    ):
        metrics = accumulate_gradients(
            worker,
            batch,
            forward=forward,
            backward=lambda loss: loss.backward(),
            loss_fn=loss_fn,
        )
    metrics.update(moe)

    grad_norm = _clip_grad_norm(model, worker.require_training_args().max_grad_norm)
    lr = float(scheduler.get_last_lr()[0])
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        log.warning(
            "fsdp: non-finite grad norm (%s) at step %d: update skipped",
            grad_norm,
            state.step,
        )
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    state.step += 1
    metrics[f"{worker.metric_prefix}/grad_norm"] = grad_norm
    metrics[f"{worker.metric_prefix}/lr"] = lr
    return metrics


def _clip_grad_norm(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm and max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _score(
    worker: WorkerContext,
    batch: SequenceBatch,
    score: Callable[..., torch.Tensor],
    forward: Callable[[SequenceBatch], Any],
) -> torch.Tensor:
    train = worker.strategy_name == TRAIN
    return score_rows(worker, batch, worker.model, score, forward, train)


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    state = worker.engine_state(FSDPState)
    actor = state.lender
    model = worker.model
    forward = logprob_forward(worker, model, train=False)
    # The trainer's own pass is the old policy's (routing_replay: old_policy records it).
    old_policy = state.old_routing if worker.strategy_name == TRAIN else None
    with scoring_forward(worker, model, forward, old_policy) as forward:
        if actor is None:
            return _score(worker, batch, score_logprobs, forward)
        with _resident(actor), model.disable_adapter():
            return _score(worker, batch, score_logprobs, forward)


@contextlib.contextmanager
def _resident(actor: WorkerContext) -> Iterator[None]:
    """The lending actor's weights on the device while a borrowing reference scores (the
    actor's role offloads them while another role runs, when its config says so)."""
    offloads = bool(_offloaded(actor, ["weights"]))
    if offloads:
        resume_memory(actor, ["weights"])
    try:
        yield
    finally:
        if offloads:
            release_memory(actor, ["weights"])


def compute_values(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    return _score(worker, batch, score_values, lambda mb: forward_logits(worker.model, mb))


def compute_scores(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    def forward(mb: SequenceBatch) -> torch.Tensor:
        return sequence_scores(worker.model, mb.input_ids, mb.attention_mask)

    return _score(worker, batch, score_sequences, forward)


# --------------------------------------------------------------------------------------------
# Weights out: sync buckets and HF export
# --------------------------------------------------------------------------------------------


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool = False
) -> Iterator[WeightBucket]:
    """Generator: gathers lazily (collectively). Through the host (``on_device=False``), rank 0
    keeps host copies and the others yield empty buckets of the same count (they bucket
    shape-only meta tensors the same way); on the device, every rank yields the gathered
    tensors where they are."""
    return _export_buckets(worker, bucket_bytes, on_device)


def _export_buckets(
    worker: WorkerContext, bucket_bytes: int, on_device: bool
) -> Iterator[WeightBucket]:
    keep = on_device or is_rank0()
    device = None if on_device else "cpu"
    gathered = _synced_adapters if adapter_sync(worker, TRAIN) else _gathered
    for bucket in bucketize(gathered(worker, keep=keep, device=device), bucket_bytes):
        yield bucket if keep else WeightBucket()


def _full(value: torch.Tensor) -> torch.Tensor:
    """A state-dict entry whole: a DTensor gathered over its mesh (a collective), or, on a mesh
    of one rank, its local tensor as it is (no collective: one per tensor cost more than the
    copies of an in-process sync)."""
    if not isinstance(value, DTensor):
        return value
    if value.device_mesh.size() == 1:
        return value.to_local()
    return value.full_tensor()


def _gathered(
    worker: WorkerContext, keep: bool, device: str | None = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every state-dict entry in the export dtype, on ``device``
    (None: where the gather left it, with no copy when the dtype matches); with ``keep=False``
    a meta tensor of the same shape stands in (the gather still runs). A LoRA model's adapted
    weights are merged (``W + scale * B @ A``, from gathered copies, the model untouched) under
    their plain HF names; the adapters themselves are not sent."""
    model = worker.model
    dtype = export_dtype(worker)
    # peft is imported only for a LoRA model.
    adapted = lora_layers(model) if lora_args(worker, TRAIN) is not None else {}
    state = model.state_dict()
    # Tied weights appear under several names: gather once.
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    alias = {n: names[0] for names in owners.values() if len(names) > 1 for n in names}
    cache: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if adapted and is_lora_adapter_entry(name):
            continue  # merged into its base weight
        exported = lora_plain_name(hf_name(name))
        source = alias.get(name)
        if source is not None and source in cache:
            yield exported, cache[source]
            continue
        full = _full(value)
        prefix = name.removesuffix(".base_layer.weight")
        if prefix != name and prefix in adapted:
            a_key, b_key = lora_adapter_keys(prefix)
            a, b = _full(state[a_key]), _full(state[b_key])
            full = merge_lora_weight(full, a, b, adapted[prefix])
        if keep and device is None:
            tensor = full.detach().to(dtype=dtype)
        elif keep:
            tensor = full.detach().to(device=device, dtype=dtype, copy=True)
        else:
            tensor = torch.empty(full.shape, dtype=dtype, device="meta")
        del full
        if source is not None:
            cache[source] = tensor
        yield exported, tensor


def _synced_adapters(
    worker: WorkerContext, keep: bool, device: str | None = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapter-only sync (``model_args.lora.sync: adapter``): every ``lora_A`` / ``lora_B``,
    gathered, in the export dtype, under its wire name; placed and stood in for as in
    :func:`_gathered`. The frozen base weights are the engine's own already."""
    dtype = export_dtype(worker)
    for name, value in worker.model.state_dict().items():
        if not is_lora_adapter_entry(name):
            continue
        full = _full(value).detach()
        if not keep:
            tensor = torch.empty(full.shape, dtype=dtype, device="meta")
        else:
            tensor = full.to(device=device or full.device, dtype=dtype, copy=device is not None)
        yield adapter_wire_name(hf_name(name)), tensor


def _adapters(worker: WorkerContext) -> Iterator[tuple[str, torch.Tensor]]:
    """The trained adapters, gathered, under their state-dict names."""
    for name, value in worker.model.state_dict().items():
        if is_lora_adapter_entry(name):
            yield hf_name(name), _full(value).detach().to("cpu", copy=True)


def export_hf(worker: WorkerContext, path: str, merge: bool = False) -> bool:
    """Streamed: every rank gathers one tensor at a time (collectively) and rank 0 writes each
    safetensors shard as soon as it is full, holding at most one shard on the host.

    With LoRA, ``path`` gets the adapter in peft's format; with ``merge``, ``path`` gets the
    merged model and ``path/adapter`` the adapter."""
    if lora_args(worker, TRAIN) is not None:
        _export_adapter(worker, os.path.join(path, "adapter") if merge else path)
        if not merge:
            return True
    model = lora_base_model(worker.model)
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        # As save_pretrained does: the tied head is rebuilt from the embeddings on load.
        tied = set(_tied_head_names(model))
    named = ((n, t) for n, t in _gathered(worker, keep=is_rank0(), device="cpu") if n not in tied)
    export_streamed(named, path, lambda out: _write_hf_config(worker, out))
    return True


def _export_adapter(worker: WorkerContext, path: str) -> None:
    tensors = dict(_adapters(worker))  # every rank gathers; rank 0 writes
    if is_rank0():
        write_lora_adapter(worker, tensors, path)
        save_tokenizer_beside(worker, path, log)
    if dist.is_initialized():
        dist.barrier()


def _write_hf_config(worker: WorkerContext, path: str) -> None:
    model = lora_base_model(worker.model)
    config = copy.deepcopy(model.config)
    config.dtype = export_dtype(worker)
    # A critic's directory loads as the value model it is (as save_pretrained records it).
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    save_tokenizer_beside(worker, path, log)


def _tied_head_names(model: torch.nn.Module) -> list[str]:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return []
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight]
    keep = [n for n, p in model.named_parameters() if p is out.weight]  # the first name stays
    return [lora_plain_name(hf_name(n)) for n in names if n not in keep]


# --------------------------------------------------------------------------------------------
# Checkpoints (torch DCP)
# --------------------------------------------------------------------------------------------


def _extra_path(path: str, rank: int) -> str:
    return os.path.join(path, f"extra_state_rank{rank}.pt")


def _state_options(worker: WorkerContext, loading: bool = False) -> StateDictOptions:
    """With LoRA, the frozen base stays out of checkpoints: it comes from model_name_or_path
    (recorded beside the adapters and checked on load). Loading such a state is not strict (the
    base's keys are absent by design); ``dcp.load`` still fails on a missing adapter key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    adapters_only = lora_args(worker, TRAIN) is not None
    return StateDictOptions(
        ignore_frozen_params=adapters_only, strict=not (loading and adapters_only)
    )


def _dcp_state(worker: WorkerContext) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    options = _state_options(worker)
    optimizer = worker.engine_state(FSDPState).optimizer
    if optimizer is None:
        return {"model": get_model_state_dict(worker.model, options=options)}
    model_sd, optim_sd = get_state_dict(worker.model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _write_extras(worker: WorkerContext, path: str, digests: FileDigests) -> dict[str, Any]:
    """Per-rank step / scheduler / RNG state and rank 0's layout file, hashed while written."""
    rank, world = _rank_world()
    state = worker.engine_state(FSDPState)
    scheduler = state.scheduler
    extra = {
        "step": state.step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        **rng_state(worker),
        "world_size": world,
    }
    with digests.open(_extra_path(path, rank)) as f:
        torch.save(extra, f)
    layout: dict[str, Any] = {"format": "torch_dcp", "dp_size": world}
    if rank == 0:
        with digests.open(os.path.join(path, "fsdp_layout.json")) as f:
            f.write(json.dumps({**layout, "strategy": worker.strategy_name}).encode())
    if lora_args(worker, TRAIN) is not None:
        layout["lora"] = True
        if rank == 0:
            with digests.open(os.path.join(path, LORA_RECORD)) as f:
                f.write(json.dumps(lora_record(worker), sort_keys=True).encode())
    return layout


def save_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from posttrain.backend import FileDigests

    os.makedirs(path, exist_ok=True)
    dcp.save(_dcp_state(worker), checkpoint_id=os.path.join(path, "dcp"))
    layout = _write_extras(worker, path, FileDigests(path))
    if dist.is_initialized():
        dist.barrier()
    return layout


def begin_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any]:
    """DCP's asynchronous save in its two halves: the state is copied into reused host buffers
    (the only part the loop waits for), then ``dcp.save`` writes the copy on a thread, over a
    gloo group of its own so that its collectives never interleave with training's, hashing
    every file as it writes it. The thread is this module's rather than ``dcp.async_save``'s
    executor, which Python waits for at exit: a rank whose driver died must not linger,
    writing into a run directory that a restarted run may reuse."""
    import torch.distributed.checkpoint as dcp

    from posttrain.backend import BackgroundSave, HostBuffers, write_threads

    finish_checkpoint(worker, path)  # the driver waits first; a direct caller may not
    os.makedirs(path, exist_ok=True)
    rank, _ = _rank_world()
    engine_state = worker.engine_state(FSDPState)
    buffers = engine_state.checkpoint_buffers
    if buffers is None:
        buffers = HostBuffers(f"{worker.role} rank {rank}", pin=is_cuda(worker))
        engine_state.checkpoint_buffers = buffers
    if dist.is_initialized() and engine_state.checkpoint_group is None:
        engine_state.checkpoint_group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=collective_timeout_s())
        )
    state = _dcp_state(worker)
    buffers.reserve(_tensor_leaves(state, ""))
    staged = _staged(state, "", buffers)
    buffers.synchronize()
    save = BackgroundSave(path, rank)
    layout = _write_extras(worker, path, save.digests)
    writer = _hashing_writer(os.path.join(path, "dcp"), save.digests, write_threads(buffers.nbytes))
    group = engine_state.checkpoint_group
    save.start(lambda: dcp.save(staged, storage_writer=writer, process_group=group))
    engine_state.background_save = save
    return layout


def finish_checkpoint(worker: WorkerContext, path: str) -> bool:
    state = worker.engine_state(FSDPState)
    save, state.background_save = state.background_save, None
    if save is not None:
        save.join()
    return True


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _tensor_leaves(value: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield key, _local(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensor_leaves(v, f"{key}/{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _tensor_leaves(v, f"{key}/{i}")


def _staged(value: Any, key: str, buffers: HostBuffers) -> Any:
    """``value`` with every tensor replaced by its host copy (a DTensor keeps its sharding
    spec around the host copy of its local shard: DCP plans from the spec)."""
    if isinstance(value, DTensor):
        return DTensor(buffers.copy(key, value.to_local()), value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        return buffers.copy(key, value)
    if isinstance(value, dict):
        return {k: _staged(v, f"{key}/{k}", buffers) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_staged(v, f"{key}/{i}", buffers) for i, v in enumerate(value))
    return value


class _HashingFileSystem(FileSystem):
    """DCP's file system, every file it writes hashed while written (renames followed: the
    coordinator writes ``.metadata.tmp`` and renames it)."""

    def __init__(self, digests: FileDigests) -> None:
        super().__init__()
        self.digests = digests

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Iterator[io.IOBase | HashingStream]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
        self.digests.record(path, stream.hexdigest())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        self.digests.renamed(path, new_path)


def _hashing_writer(path: str, digests: FileDigests, threads: int = 1) -> FileSystemWriter:
    """DCP's writer with ``threads`` files per rank written at once, each hashed as written."""
    writer = FileSystemWriter(path, thread_count=threads)
    writer.fs = _HashingFileSystem(digests)
    return writer


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    check_lora_record(worker, path, lora_args(worker, TRAIN))
    state = _dcp_state(worker)
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    options = _state_options(worker, loading=True)
    engine_state = worker.engine_state(FSDPState)
    optimizer = engine_state.optimizer
    if optimizer is None:
        set_model_state_dict(worker.model, state["model"], options=options)
    else:
        set_state_dict(
            worker.model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    own = _extra_path(path, rank)
    extra_file = own if os.path.exists(own) else _extra_path(path, 0)
    if os.path.exists(extra_file):
        extra = torch.load(extra_file, weights_only=False)
        engine_state.step = extra.get("step", 0)
        scheduler = engine_state.scheduler
        if scheduler is not None and extra.get("scheduler") is not None:
            scheduler.load_state_dict(extra["scheduler"])
        if extra.get("world_size") == world and extra_file == own:  # same layout: same RNG
            restore_rng_state(worker, extra)
    if dist.is_initialized():
        dist.barrier()
    return True


# --------------------------------------------------------------------------------------------
# Memory lifecycle and shutdown
# --------------------------------------------------------------------------------------------


def _optimizers(worker: WorkerContext) -> list[torch.optim.Optimizer]:
    optimizer = worker.engine_state(FSDPState).optimizer
    return [] if optimizer is None else [optimizer]


def _offloaded(worker: WorkerContext, tags: list[str]) -> set[str]:
    """The asked tags this role's config offloads (``param_offload``: weights and grads,
    ``optimizer_offload``: the optimizer state); none by default (``auto`` is resolved by the
    memory plan before the run; left unresolved, without a plan, it means off)."""
    cfg = worker.config
    offloaded = {"weights", "grads"} if cfg.param_offload is True else set()
    if getattr(cfg, "optimizer_offload", False) is True:
        offloaded.add("optimizer")
    return memory_tags(tags) & offloaded


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if worker.engine_state(FSDPState).lender is not None:
        return True  # a borrowed model: its owner (the actor) moves it
    if not is_cuda(worker):
        log_once(log, "fsdp: release_memory on a CPU device: nothing to free")
        return True
    wanted = _offloaded(worker, tags)
    if not wanted:
        return True  # nothing offloaded: no sync, no emptied cache
    if wanted & {"weights", "grads"}:
        worker.model.zero_grad(set_to_none=True)
        worker.model.cpu()
    if "optimizer" in wanted:
        move_optimizer_state(_optimizers(worker), "cpu")
    settle_cuda(empty_cache=True)
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if worker.engine_state(FSDPState).lender is not None:
        return True
    if not is_cuda(worker):
        return True
    wanted = _offloaded(worker, tags)
    if not wanted:
        return True
    device = rank_device(worker)
    offloaded = getattr(worker.config, "cpu_offload", False)
    if wanted & {"weights", "grads"} and not offloaded:
        worker.model.to(device)
    if "optimizer" in wanted and not offloaded:
        move_optimizer_state(_optimizers(worker), device)
    settle_cuda()
    return True


def shutdown_worker(worker: WorkerContext) -> bool:
    lora.forget(worker)
    worker.state.clear()  # this role's FSDPState, and the engine objects it holds, go
    worker.model = None
    end_process_group()
    return True
