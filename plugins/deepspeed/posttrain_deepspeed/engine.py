"""Engine side of ``deepspeed_train`` / ``deepspeed_infer``: an HF causal LM in a DeepSpeed engine.

A vision-language model (Qwen2-VL style) is its image-text-to-text class: every pass feeds it
the batch's images, and ``model_args.freeze_vision`` freezes its vision tower before the
optimizer is built.

``worker.model`` is the :class:`deepspeed.DeepSpeedEngine`; ``engine.module`` is the HF model, so
parameter names are HF names. Gradient accumulation is unmanaged
(``managed_gradient_accumulation: false``): the number of micro-batches may change from step to
step (dynamic batching), ``engine.backward`` accumulates and ``engine.step`` is the boundary.

Collectives (ZeRO-3 parameter gathers in forward, ZeRO-2/3 gradient reduction in backward) need
every rank to run the same passes: micro-batch counts are agreed on before a step, and ranks with
fewer micro-batches run zero-weight ones.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch
import torch.distributed as dist

from posttrain import CheckpointError, SequenceBatch, UserError, WeightBucket, bucketize
from posttrain.backend import (
    LORA_RECORD,
    OldPolicyRouting,
    accumulate_gradients,
    adamw,
    adapter_sync,
    adapter_wire_name,
    backend_for,
    check_lora_record,
    enable_gradient_checkpointing,
    end_process_group,
    export_dtype,
    forward_logits,
    init_default_process_group,
    is_cuda,
    is_lora_adapter_entry,
    is_rank0,
    load_causal_lm,
    log_once,
    logprob_forward,
    lora_adapter_keys,
    lora_args,
    lora_base_model,
    lora_layers,
    lora_plain_name,
    lora_record,
    lr_lambda,
    merge_lora_weight,
    micro_batch_size,
    no_hf_progress_bars,
    rank_device,
    resolve_model_path,
    restore_rng_state,
    rng_state,
    save_tokenizer_beside,
    score_logprobs,
    score_rows,
    scoring_forward,
    settle_cuda,
    update_forward,
    wrap_lora,
    write_lora_adapter,
)

if TYPE_CHECKING:
    from types import ModuleType

    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from peft.tuners.lora import Linear as LoraLinear

    from posttrain import ModelArgs, TrainingArgs, WorkerContext

    # A LoRA-adapted weight's adapters and their layer: (A, B, peft's LoRA linear).
    Adapter = tuple[torch.Tensor, torch.Tensor, LoraLinear]

log = logging.getLogger(__name__)

TRAIN = "deepspeed_train"
TAG = "deepspeed"  # DeepSpeed's checkpoint tag (a sub-directory of the role's directory)
LAYOUT_FILE = "deepspeed_layout.json"


@attrs.define(kw_only=True)
class DeepSpeedState:
    """This role's engine objects between calls (``worker.engine_state(DeepSpeedState)``);
    the DeepSpeed engine itself is ``worker.model``."""

    # The LR scheduler DeepSpeed wraps (None for deepspeed_infer).
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step: int = 0
    # The config DeepSpeed was initialised with (typed fields and ds_config merged).
    ds_config: dict[str, Any] = attrs.field(factory=dict)
    # ids of the parameters that appear under several names (tied weights), found once.
    tied_ids: set[int] | None = None
    # What the last release_memory moved to the host: the ZeRO optimizer's buffers
    # ("states") or the module itself ("module"); None: nothing.
    released: Literal["states", "module"] | None = None
    # routing_replay: old_policy: the old-policy pass's routing, until the update replays it.
    old_routing: OldPolicyRouting = attrs.field(factory=OldPolicyRouting)


# --------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------


def _deepspeed(worker: WorkerContext) -> ModuleType:
    """Import DeepSpeed with the accelerator matching the worker's device (it is chosen once, at
    DeepSpeed's first import, from ``DS_ACCELERATOR``)."""
    wanted = "cuda" if is_cuda(worker) else "cpu"
    os.environ.setdefault("DS_ACCELERATOR", wanted)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != wanted:
        raise UserError(
            f"role {worker.role}: DeepSpeed's accelerator is {got!r} but the role runs on "
            f"{wanted!r} (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}): unset "
            "DS_ACCELERATOR or set it to match the device"
        )
    return deepspeed


def _skip_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory comm op on CPU.

    Its comm layer builds that C++ op when it starts on the CPU accelerator (a first run on 2
    cores took ~80 s, and it needs a compiler), yet only its inference all-reduce uses it:
    training runs through torch.distributed over gloo. DeepSpeed builds the op only where its
    cached table of compatible ops says so, and that table is a module-level dict meant to be
    edited.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    deepspeed = _deepspeed(worker)
    if not is_cuda(worker):
        _skip_shm_comm_op()
    # Spawned rank processes start with a random global seed: seed it from the run's seed so
    # that whatever draws from it (dropout) repeats from run to run, and a checkpoint's saved
    # RNG state is the one an uninterrupted run has at that step.
    torch.manual_seed(worker.seed + worker.rank)
    init_default_process_group(worker.device)
    # DeepSpeed's comm layer wraps the default group torch.distributed already has.
    deepspeed.init_distributed(dist_backend=backend_for(worker.device), dist_init_required=False)
    return {"dp_rank": dist.get_rank(), "dp_size": dist.get_world_size()}


def _refuse_on_cpu(worker: WorkerContext) -> None:
    if is_cuda(worker):
        return
    if worker.model_args.dtype == "fp16":
        raise UserError(
            f"role {worker.role}: {worker.strategy_name} with model_args.dtype fp16 needs a GPU: "
            "DeepSpeed's fp16 mixed precision (loss scaling, fused fp16 optimizer paths) is not "
            "supported by its CPU accelerator; use bf16 or fp32 on CPU"
        )
    cfg = worker.config
    if getattr(cfg, "offload_optimizer", False) or cfg.offload_param:
        log_once(
            log,
            "deepspeed: offload_optimizer / offload_param have no effect on a CPU device "
            "(parameters and optimizer state already live in host memory)",
            logging.INFO,
        )


def build_ds_config(worker: WorkerContext) -> dict[str, Any]:
    """The DeepSpeed config of this role: the typed fields, then ``ds_config`` merged over."""
    cfg = worker.config
    train = worker.strategy_name == TRAIN
    cuda = is_cuda(worker)
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": cfg.contiguous_gradients,
        "reduce_bucket_size": cfg.reduce_bucket_size,
        "allgather_bucket_size": cfg.allgather_bucket_size,
    }
    if cfg.zero_stage == 3:
        zero.update(
            stage3_param_persistence_threshold=cfg.stage3_param_persistence_threshold,
            stage3_max_live_parameters=cfg.stage3_max_live_parameters,
            stage3_max_reuse_distance=cfg.stage3_max_reuse_distance,
            stage3_prefetch_bucket_size=cfg.stage3_prefetch_bucket_size,
        )
    if cuda and cfg.offload_param and cfg.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if cuda and train and cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    dtype = worker.model_args.dtype
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size(
            worker, worker.strategy_name == TRAIN, False
        ),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        # Any torch optimizer is fine with ZeRO (DeepSpeed lists only its own as tested).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if train:
        args = worker.require_training_args()
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else 0.0
        config["gradient_clipping"] = float(clip)
        if "offload_optimizer" in zero:
            config["optimizer"] = {"type": "AdamW", "params": _adamw_params(args)}
    return _merge(config, dict(cfg.ds_config))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _adamw_params(args: TrainingArgs) -> dict[str, Any]:
    return {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }


def load_model(worker: WorkerContext) -> DeepSpeedEngine:
    deepspeed = _deepspeed(worker)
    _refuse_on_cpu(worker)
    cfg = worker.config
    train = worker.strategy_name == TRAIN
    if train and worker.training_args is None:
        raise UserError(f"role {worker.role}: deepspeed_train needs training_args")
    ds_config = build_ds_config(worker)
    if cfg.zero_stage == 3 and cfg.zero_init:
        module = _load_partitioned(worker, deepspeed, ds_config)
    else:
        # float32 on the host; DeepSpeed casts to bf16 / fp16 and moves to the device.
        module = load_causal_lm(_fp32(worker.model_args), worker.base_dir, "cpu")
    if train and not worker.model_args.disable_gradient_checkpointing:
        enable_gradient_checkpointing(module)
    vision = getattr(getattr(module, "model", None), "visual", None)
    if train and vision is not None and worker.model_args.freeze_vision:
        # A vision-language model's tower, frozen before deepspeed.initialize: the optimizer
        # (and ZeRO's partitions of its state and gradients) holds nothing for it.
        vision.requires_grad_(False)
    if lora_args(worker, TRAIN) is not None:
        # Before deepspeed.initialize: the engine (and ZeRO's partitions) holds the adapters,
        # the optimizer only the trainable ones.
        module = wrap_lora(worker, module)
    optimizer = scheduler = None
    if train:
        args = worker.require_training_args()
        if "optimizer" not in ds_config:
            optimizer = adamw((p for p in module.parameters() if p.requires_grad), args)
        multiplier = lr_lambda(args)

        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.LambdaLR(opt, multiplier)

    else:
        for p in module.parameters():
            p.requires_grad_(False)
    try:
        engine, _, _, lr_scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            model_parameters=None
            if optimizer is not None or not train
            else [p for p in module.parameters() if p.requires_grad],
            lr_scheduler=scheduler,
            config=ds_config,
            dist_init_required=False,
        )
    except (ValueError, TypeError, AssertionError) as exc:
        raise UserError(
            f"role {worker.role}: DeepSpeed refused the config built from strategy_config "
            f"(ds_config passthrough included): {type(exc).__name__}: {exc}\n"
            f"config: {json.dumps(ds_config, default=str)}"
        ) from exc
    state = worker.engine_state(DeepSpeedState)
    state.scheduler = lr_scheduler
    state.step = 0
    state.ds_config = ds_config
    if train:
        engine.train()
    else:
        engine.eval()
    return engine


def _fp32(model_args: ModelArgs) -> ModelArgs:
    return attrs.evolve(model_args, dtype="fp32")


def _load_partitioned(
    worker: WorkerContext, deepspeed: ModuleType, ds_config: dict[str, Any]
) -> torch.nn.Module:
    """ZeRO-3: build the model partitioned (``zero.Init``), then load the checkpoint one tensor at
    a time (rank 0 reads it from the safetensors files, each gathered parameter is broadcast
    back into its partitions): no rank holds the whole model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_args = worker.model_args
    path = resolve_model_path(model_args.model_name_or_path, worker.base_dir)
    files = _safetensors_files(path)
    if files is None:
        raise UserError(
            f"role {worker.role}: zero_init loads the model partitioned from a local directory "
            f"with safetensors weights; {path!r} has none (set strategy_config.zero_init: false "
            "to load it whole on every rank first)"
        )
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    # The class load_causal_lm picks: a vision-language model (Qwen2-VL style) is no
    # AutoModelForCausalLM in transformers 5, its image-text-to-text class takes the images.
    auto = (
        AutoModelForImageTextToText
        if getattr(hf_config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    # zero.Init patches torch.Tensor.__new__ while it is open: what imports torch._dynamo for the
    # first time in there (transformers does, lazily) fails its signature check. Import first.
    for name in ("torch._dynamo", "transformers.integrations.flash_attention"):
        importlib.import_module(name)

    # Every weight is loaded below: skip HF's initialisation (it indexes into partitions).
    # No dtype argument: zero.Init's own pick follows the config (fp32 unless bf16 / fp16 is on);
    # an explicit dtype is dropped for bf16 on accelerators without fp16 (the CPU's) by an
    # operator-precedence slip in DeepSpeed 0.19's Init._set_dtype.
    with deepspeed.zero.Init(config_dict_or_path=ds_config), _no_init():
        module = auto.from_config(
            hf_config, trust_remote_code=model_args.trust_remote_code, **kwargs
        )
    module.tie_weights()  # no_init_weights skipped it too
    rank0 = is_rank0()
    # The module's name of each checkpoint tensor -> (its file, its name there).
    index: dict[str, tuple[str, str]] = {}
    if rank0:
        renamed = _checkpoint_names(module)
        for file in files:
            with safe_open(file, framework="pt") as f:
                keys = f.keys()  # a safetensors file is no mapping: it has keys(), no __iter__
            index.update({renamed(key): (file, key) for key in keys})
    tied = {n for n, _ in _tied_names(module)}
    # Which names the files hold, known on rank 0: one collective for all (the object
    # broadcast goes through the group's device, NCCL included).
    names = [sorted(index)]
    if dist.is_initialized():
        dist.broadcast_object_list(names, 0)
    present = set(names[0])
    missing = []
    for name, param in module.named_parameters():
        if name not in present:
            if name not in tied:
                missing.append(name)
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if rank0:
                file, key = index[name]
                with safe_open(file, framework="pt") as f:
                    param.data.copy_(f.get_tensor(key).to(param.dtype))
    device = rank_device(worker)
    for name, buf in module.named_buffers():
        if rank0 and name in index:
            file, key = index[name]
            with safe_open(file, framework="pt") as f:
                buf.data.copy_(f.get_tensor(key))
        if dist.is_initialized():
            # Sent from the group's device (a host buffer cannot go over NCCL).
            sent = buf.data.to(device)
            dist.broadcast(sent, 0)
            buf.data.copy_(sent)
    if missing:
        raise UserError(
            f"role {worker.role}: {path}: weights missing from the checkpoint: {missing}"
        )
    return module


def _checkpoint_names(module: torch.nn.Module) -> Callable[[str], str]:
    """The module's name of a checkpoint tensor's name. transformers 5 saves some models under
    names other than their modules' (Qwen2-VL's ``visual.*`` and ``model.layers.*`` are
    ``model.visual.*`` and ``model.language_model.*`` in the module) and renames them when
    ``from_pretrained`` loads; this loader reads the files itself, so it renames alike. Only
    renamings: a conversion that reshapes tensors (fused experts) leaves the names, and the
    weights it would make are reported missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # transformers 4.x loads the names as saved
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(module) if isinstance(t, WeightRenaming)]
    return lambda key: apply_renamings(key, renamings)


def _no_init() -> contextlib.AbstractContextManager[Any]:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _safetensors_files(path: str) -> list[str] | None:
    if not os.path.isdir(path):
        return None
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    return None


def _tied_names(module: torch.nn.Module) -> list[tuple[str, str]]:
    """``(name, owner name)`` of every parameter that is another parameter under a second name."""
    first: dict[int, str] = {}
    out = []
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name:
            out.append((name, owner))
    return out


# --------------------------------------------------------------------------------------------
# Training and scoring
# --------------------------------------------------------------------------------------------


def train_step(
    worker: WorkerContext, batch: SequenceBatch, loss_fn: Callable[..., Any]
) -> dict[str, float]:
    engine = worker.model
    state = worker.engine_state(DeepSpeedState)
    scheduler = state.scheduler
    engine.train()
    forward = _logprob_forward(worker, train=True)
    device = rank_device(worker)
    # Open through the backward passes: checkpointed layers replay the routing again.
    moe: dict[str, float] = {}  # how the rollout's routing compares with ours, when replayed
    with update_forward(worker, engine.module, batch, forward, state.old_routing, device, moe) as (
        batch,
        forward,
    ):
        metrics = accumulate_gradients(
            worker,
            batch,
            forward=forward,
            # The core's loss is already normalised over the whole step: no 1/accumulation
            # scaling.
            backward=lambda loss: engine.backward(loss, scale_wrt_gas=False),
            loss_fn=loss_fn,
        )
    metrics.update(moe)

    lr = float(scheduler.get_last_lr()[0]) if scheduler is not None else float("nan")
    engine.step()  # reduce (ZeRO-1) / finalize (ZeRO-2/3), clip, update, scheduler step
    norm = engine.get_global_grad_norm()
    grad_norm = float(norm) if norm is not None else float("nan")
    if not math.isfinite(grad_norm):
        log.warning("deepspeed: non-finite grad norm (%s) at step %d", grad_norm, state.step)
    engine.zero_grad()
    state.step += 1
    metrics["actor/grad_norm"] = grad_norm
    metrics["actor/lr"] = lr
    return metrics


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    train = worker.strategy_name == TRAIN
    forward = _logprob_forward(worker, train=False)
    # The trainer's own pass is the old policy's (routing_replay: old_policy records it).
    old_policy = worker.engine_state(DeepSpeedState).old_routing if train else None
    with scoring_forward(worker, worker.model.module, forward, old_policy) as forward:
        return score_rows(worker, batch, worker.model, score_logprobs, forward, train)


def _logprob_forward(worker: WorkerContext, train: bool) -> Callable[[SequenceBatch], Any]:
    """The micro-batch forward of a train step (``train``) or of scoring: the chunked head reads
    the HF model inside the DeepSpeed engine; full logits come through the engine, in fp32."""
    engine = worker.model
    return logprob_forward(
        worker,
        engine,
        train=train,
        hf_model=engine.module,
        logits_forward=lambda mb: forward_logits(engine, mb).float(),
    )


# --------------------------------------------------------------------------------------------
# Weights out: sync buckets and HF export
# --------------------------------------------------------------------------------------------


def _is_partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


def _full_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.ds_shape if _is_partitioned(tensor) else tensor.shape


def export_weights(
    worker: WorkerContext, bucket_bytes: int, on_device: bool = False
) -> Iterator[WeightBucket]:
    """Generator of buckets of HF-named full tensors in the export dtype.

    ``on_device=False``: rank 0 yields the tensors on the host; the other ranks yield empty
    buckets, as many. ``on_device=True`` (in-process hand-over, a broadcast from the device):
    every rank yields the tensors, left on the trainer's device. At ZeRO-3 one bucket's
    parameters are gathered at a time (one all-gather per bucket), so no rank ever holds the
    whole model.
    """
    return _export_buckets(worker, bucket_bytes, on_device)


def _plan(
    worker: WorkerContext, bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor, Adapter | None]]]:
    """Buckets of ``(hf_name, parameter or buffer, adapter)`` in state-dict order, sized by full
    shapes (the same plan on every rank, whatever each rank holds). With LoRA, an adapted
    weight's ``adapter`` is ``(A, B, peft layer)``, to be merged into it under its plain HF name;
    the adapters themselves are not sent. With ``lora.sync: adapter`` the plan holds the
    adapters alone, under their wire names. Otherwise ``adapter`` is None."""
    dtype = export_dtype(worker)
    module = worker.model.module
    entries = list(module.state_dict(keep_vars=True).items())
    adapted = lora_layers(module) if lora_args(worker, TRAIN) is not None else {}
    adapters_only = adapter_sync(worker, TRAIN)  # the engine keeps its own frozen base
    state = dict(entries)
    sources: dict[str, tuple[torch.Tensor, Adapter | None]] = {}
    for name, value in entries:
        if adapted and is_lora_adapter_entry(name):
            if adapters_only:
                sources[adapter_wire_name(name)] = (value, None)
            continue
        if adapters_only:
            continue
        adapter: Adapter | None = None
        prefix = name.removesuffix(".base_layer.weight")
        if prefix != name and prefix in adapted:
            a_key, b_key = lora_adapter_keys(prefix)
            adapter = (state[a_key], state[b_key], adapted[prefix])
        sources[lora_plain_name(name)] = (value, adapter)
    shaped = (
        (name, torch.empty(_full_shape(value), dtype=dtype, device="meta"))
        for name, (value, _) in sources.items()
    )
    return [
        [(n, *sources[n]) for n, _ in bucket.tensors] for bucket in bucketize(shaped, bucket_bytes)
    ]


def _export_buckets(
    worker: WorkerContext, bucket_bytes: int, on_device: bool
) -> Iterator[WeightBucket]:
    deepspeed = _deepspeed(worker)
    dtype = export_dtype(worker)
    keep = on_device or is_rank0()
    cache: dict[int, torch.Tensor] = {}  # tied weights: one gather, several names
    for planned in _plan(worker, bucket_bytes):
        gather: dict[int, Any] = {}
        for _, value, adapter in planned:
            for source in (value, *(adapter[:2] if adapter else ())):
                if _is_partitioned(source) and id(source) not in cache:
                    gather[id(source)] = source
        context = (
            deepspeed.zero.GatheredParameters(list(gather.values()), modifier_rank=None)
            if gather
            else contextlib.nullcontext()
        )
        bucket = WeightBucket()
        with context:
            for name, value, adapter in planned:
                tensor = cache.get(id(value))
                if tensor is None:
                    tensor = _export_tensor(value, dtype, on_device, keep, adapter)
                    cache[id(value)] = tensor
                bucket.tensors.append((name, tensor))
        # Drop cached tensors no later bucket names (only tied weights repeat).
        cache = {k: v for k, v in cache.items() if _tied_later(worker, k)}
        yield bucket if keep else WeightBucket()


def _tied_later(worker: WorkerContext, key: int) -> bool:
    state = worker.engine_state(DeepSpeedState)
    tied = state.tied_ids
    if tied is None:
        module = worker.model.module
        ids: dict[int, int] = {}
        for _, param in module.named_parameters(remove_duplicate=False):
            ids[id(param)] = ids.get(id(param), 0) + 1
        tied = {k for k, n in ids.items() if n > 1}
        state.tied_ids = tied
    return key in tied


def _export_tensor(
    value: torch.Tensor,
    dtype: torch.dtype,
    on_device: bool,
    keep: bool,
    adapter: Adapter | None = None,
) -> torch.Tensor:
    data = value.detach()
    if not keep:
        return torch.empty(0, dtype=dtype, device="meta")
    if adapter is not None:  # a new tensor: the trained weight is untouched
        a, b, layer = adapter
        merged = merge_lora_weight(data, a.detach(), b.detach(), layer)
        return merged.to(device=data.device if on_device else "cpu", dtype=dtype)
    if not on_device:
        return data.to(device="cpu", dtype=dtype, copy=True)
    if data.dtype != dtype:
        return data.to(dtype)
    # A gathered ZeRO-3 parameter's storage is released when its gather ends: copy it (on the
    # device); other parameters are handed out as they are (no copy).
    return data.clone() if _is_partitioned(value) else data


def full_state_dict(worker: WorkerContext) -> dict[str, torch.Tensor]:
    """The full HF-named state dict on rank 0 (CPU, export dtype); empty on other ranks."""
    state: dict[str, torch.Tensor] = {}
    for bucket in _export_buckets(worker, 256 << 20, on_device=False):
        state.update(bucket.tensors)
    return state


def export_hf(worker: WorkerContext, path: str, merge: bool = False) -> bool:
    """The HF model into ``path``. With LoRA, ``path`` gets the adapter in peft's format; with
    ``merge``, ``path`` gets the merged model and ``path/adapter`` the adapter."""
    if lora_args(worker, TRAIN) is not None:
        _export_adapter(worker, os.path.join(path, "adapter") if merge else path)
        if not merge:
            return True
    state = full_state_dict(worker)
    if is_rank0():
        _write_hf_dir(worker, state, path)
    if dist.is_initialized():
        dist.barrier()
    return True


def _export_adapter(worker: WorkerContext, path: str) -> None:
    """The trained adapters (gathered at ZeRO-3: every rank joins), written by rank 0."""
    deepspeed = _deepspeed(worker)
    module = worker.model.module
    tensors = {}
    for name, param in module.state_dict(keep_vars=True).items():
        if not is_lora_adapter_entry(name):
            continue
        context = (
            deepspeed.zero.GatheredParameters([param], modifier_rank=None)
            if _is_partitioned(param)
            else contextlib.nullcontext()
        )
        with context:
            tensors[name] = param.detach().to("cpu", copy=True)
    if is_rank0():
        write_lora_adapter(worker, tensors, path)
        save_tokenizer_beside(worker, path, log)
    if dist.is_initialized():
        dist.barrier()


def _write_hf_dir(worker: WorkerContext, state: dict[str, torch.Tensor], path: str) -> None:
    module = lora_base_model(worker.model.module)
    os.makedirs(path, exist_ok=True)
    # transformers writes the safetensors (sharded when large) and drops tied duplicates.
    with no_hf_progress_bars():
        module.save_pretrained(path, state_dict=state, safe_serialization=True)
    config = copy.deepcopy(module.config)
    config.dtype = export_dtype(worker)
    config.save_pretrained(path)
    save_tokenizer_beside(worker, path, log)


# --------------------------------------------------------------------------------------------
# Checkpoints (DeepSpeed's own format)
# --------------------------------------------------------------------------------------------


def _extra_path(path: str, rank: int) -> str:
    return os.path.join(path, f"extra_state_rank{rank}.pt")


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_checkpoint(worker: WorkerContext, path: str) -> dict[str, Any]:
    engine = worker.model
    os.makedirs(path, exist_ok=True)
    rank, world = _world()
    layout = {
        "format": "deepspeed",
        "zero_stage": worker.config.zero_stage,
        "dp_size": world,
        "strategy": worker.strategy_name,
    }
    adapters_only = lora_args(worker, TRAIN) is not None
    # Model, optimizer partitions (fp32 master weights) and the LR scheduler, per DeepSpeed.
    # With LoRA the frozen base stays out: it comes from model_name_or_path (recorded beside the
    # adapters and checked on load).
    engine.save_checkpoint(
        path, tag=TAG, save_latest=False, exclude_frozen_parameters=adapters_only
    )
    extra = {
        "step": worker.engine_state(DeepSpeedState).step,
        **rng_state(worker),
        "world_size": world,
    }
    torch.save(extra, _extra_path(path, rank))
    if rank == 0:
        with open(os.path.join(path, LAYOUT_FILE), "w") as f:
            json.dump(layout, f)
        if adapters_only:
            with open(os.path.join(path, LORA_RECORD), "w", encoding="utf-8") as f:
                json.dump(lora_record(worker), f, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()
    return {"format": "deepspeed", "zero_stage": worker.config.zero_stage, "dp_size": world}


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    engine = worker.model
    rank, world = _world()
    layout_file = os.path.join(path, LAYOUT_FILE)
    if not os.path.exists(layout_file):
        raise CheckpointError(f"{path}: not a deepspeed checkpoint (no {LAYOUT_FILE})")
    with open(layout_file, encoding="utf-8") as f:
        layout = json.load(f)
    if layout["dp_size"] != world or layout["zero_stage"] != worker.config.zero_stage:
        raise CheckpointError(
            f"{path}: written by {layout['dp_size']} rank(s) at ZeRO-{layout['zero_stage']}, "
            f"loaded by {world} rank(s) at ZeRO-{worker.config.zero_stage}: DeepSpeed's "
            "partitioned optimizer state loads only into the same layout (convert it with "
            "DeepSpeed's ds_to_universal.py and load with ds_config: {checkpoint: "
            "{load_universal: true}}, or resume with the same ranks and stage)"
        )
    train = worker.strategy_name == TRAIN
    adapters = lora_args(worker, TRAIN)
    check_lora_record(worker, path, adapters)
    load_path, _ = engine.load_checkpoint(
        path,
        tag=TAG,
        load_optimizer_states=train,
        load_lr_scheduler_states=train,
        # A checkpoint of adapters lacks the frozen base's keys by design.
        load_module_strict=adapters is None,
    )
    if load_path is None:
        raise CheckpointError(f"{path}: DeepSpeed found no checkpoint under tag {TAG!r}")
    extra_file = _extra_path(path, rank)
    if os.path.exists(extra_file):
        extra = torch.load(extra_file, weights_only=False)
        worker.engine_state(DeepSpeedState).step = extra.get("step", 0)
        restore_rng_state(worker, extra)
    if dist.is_initialized():
        dist.barrier()
    return True


# --------------------------------------------------------------------------------------------
# Memory lifecycle and shutdown
# --------------------------------------------------------------------------------------------

# The core's release tags -> DeepSpeed's ZeRO buffers (OffloadStateTypeEnum values).
_OFFLOAD_TAGS = {
    "weights": ("lp_params",),
    "grads": ("lp_grads", "contiguous_grad_buffer"),
    "optimizer": ("optim_states", "hp_params"),
}


def _offload_kinds(tags: list[str] | None) -> list[OffloadStateTypeEnum]:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    names = {n for tag in (tags or ("weights",)) for n in _OFFLOAD_TAGS.get(tag, ())}
    return [OffloadStateTypeEnum(n) for n in sorted(names)]


def _move_module(module: torch.nn.Module, device: str | torch.device) -> None:
    """Move a model with no ZeRO optimizer (deepspeed_infer): at ZeRO-3 each parameter's own
    partition (``ds_tensor``) moves, the (empty) gathered placeholder with it."""
    for param in module.parameters():
        if _is_partitioned(param):
            param.ds_tensor.data = param.ds_tensor.data.to(device)
        param.data = param.data.to(device)
    for buf in module.buffers():
        buf.data = buf.data.to(device)


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if not is_cuda(worker):
        log_once(log, "deepspeed: release_memory on a CPU device: nothing to free")
        return True
    if worker.config.release_when_idle is not True:  # auto: the memory plan said off
        return True  # the states stay on the device: no sync, no emptied cache
    engine = worker.model
    if engine.optimizer is not None and hasattr(engine.optimizer, "offload_states"):
        # A ZeRO optimizer (any stage) owns the flat buffers the parameters are views of:
        # moving the module itself would break those views, so DeepSpeed moves its buffers.
        engine.offload_states(include=_offload_kinds(tags), non_blocking=True)
        worker.engine_state(DeepSpeedState).released = "states"
    else:
        _move_module(engine.module, "cpu")
        worker.engine_state(DeepSpeedState).released = "module"
    settle_cuda(empty_cache=True)
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    state = worker.engine_state(DeepSpeedState)
    released, state.released = state.released, None
    if not is_cuda(worker) or released is None:
        return True
    engine = worker.model
    if released == "states":
        engine.reload_states(non_blocking=True)
    else:
        _move_module(engine.module, rank_device(worker))
    settle_cuda()
    return True


def shutdown_worker(worker: WorkerContext) -> bool:
    engine = worker.model
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()
    worker.state.clear()  # this role's DeepSpeedState, and the engine objects it holds, go
    worker.model = None
    end_process_group()
    return True
