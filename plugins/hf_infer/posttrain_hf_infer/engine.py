"""Engine side of ``hf_infer``: sampling with per-token log-probs, and sequence scoring.

Reported log-probs are those of the model's own distribution (temperature 1, before top-k/top-p),
as vLLM and SGLang report them by default, so they compare directly with a trainer's forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.distributed.tensor import DTensor, Shard

from posttrain import (
    GenerationRequest,
    RolloutSamples,
    SamplingParams,
    SequenceBatch,
    UserError,
    WeightBucket,
)
from posttrain.backend import (
    IMAGE_KEYS,
    ROUTING_KEY,
    TokenLogprobs,
    end_process_group,
    forward_logits,
    init_default_process_group,
    is_cuda,
    load_causal_lm,
    load_model_with_head,
    load_tokenizer,
    log_once,
    logprob_forward,
    lora_scaling,
    memory_tags,
    no_hf_progress_bars,
    parse_adapter_wire_name,
    record_routing,
    scoring_forward,
    sequence_scores,
    shifted_token_logprobs,
    synced_adapter,
    unshare_storage,
)
from posttrain_hf_infer.adapters import adapter_buffers, attach_adapters, merged_state
from posttrain_hf_infer.background_compile import BackgroundCompile, compiles_in_background
from posttrain_hf_infer.decode_loop import DynamicDecode, StaticDecode, sample_rows
from posttrain_hf_infer.fused_linears import fuse_sibling_linears, unfuse_sibling_linears
from posttrain_hf_infer.routing import RoutedDecode
from posttrain_hf_infer.static_decode import DecodeSettings, StaticDecoders, supports_static
from posttrain_hf_infer.token_sampling import draw, gumbel_draw, is_plain
from posttrain_hf_infer.vision import VisionDecode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain import WorkerContext
    from posttrain_hf_infer.token_sampling import Draw

LOG = logging.getLogger(__name__)


@attrs.define(kw_only=True)
class HFInferState:
    """What a rank keeps between calls (``worker.engine_state(HFInferState)``)."""

    tokenizer: PreTrainedTokenizerBase | None = None  # set by load_model
    # This rank's replica axis when the replica is split over ranks (tensor_parallel_size > 1).
    tp_mesh: DeviceMesh | None = None
    # The fixed-shape decoders, kept from one generation to the next (their caches, graphs).
    decoders: StaticDecoders | None = None
    # Page-locked host buffers the weights wait in while released, kept for the next release.
    pinned: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # decode auto: the compiled step being built in the background (background_compile).
    compile_job: BackgroundCompile | None = None
    # The decode mode that served the latest generation (auto resolved).
    decode_served: str = ""


def _state(worker: WorkerContext) -> HFInferState:
    return worker.engine_state(HFInferState)


def _tokenizer(worker: WorkerContext) -> PreTrainedTokenizerBase:
    tokenizer = _state(worker).tokenizer
    if tokenizer is None:
        raise RuntimeError("hf_infer: the tokenizer is loaded with the model (load_model)")
    return tokenizer


def _sharded(worker: WorkerContext) -> bool:
    """Whether this rank holds a share of a replica split over ranks."""
    return _state(worker).tp_mesh is not None


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    tp = worker.config.tensor_parallel_size
    if tp == 1:
        # Every rank is an independent replica: no process group is needed.
        return {"dp_rank": worker.rank, "dp_size": worker.world_size}
    # Replicas of ``tp`` consecutive ranks: one device mesh (replica, shard) over the role's
    # process group; each replica's ranks decode the same requests in step.
    from torch.distributed.device_mesh import init_device_mesh

    if worker.world_size % tp:
        raise UserError(
            f"hf_infer: {worker.world_size} ranks cannot be split into replicas of "
            f"tensor_parallel_size={tp}"
        )
    init_default_process_group(worker.device)
    mesh = init_device_mesh(
        "cuda" if is_cuda(worker) else "cpu",
        (worker.world_size // tp, tp),
        mesh_dim_names=("replica", "shard"),
    )
    _state(worker).tp_mesh = mesh["shard"]
    return {
        "dp_rank": worker.rank // tp,
        "dp_size": worker.world_size // tp,
        "tp_rank": worker.rank % tp,
        "tp_size": tp,
    }


def load_model(worker: WorkerContext) -> PreTrainedModel:
    mesh = _state(worker).tp_mesh
    if mesh is not None:
        model = load_causal_lm(worker.model_args, worker.base_dir, worker.device, tp_mesh=mesh)
    else:
        model = load_model_with_head(worker.model_args, worker.head, worker.base_dir, worker.device)
    model.eval()
    adapter = synced_adapter(worker)
    if adapter is not None:
        if mesh is not None:
            raise UserError(
                "hf_infer: synced LoRA adapters (model_args.lora.sync: adapter) need whole "
                "weights: set tensor_parallel_size: 1, or lora.sync: merged"
            )
        # Zero until the first sync: the base alone is the policy, as peft's B starts at zero.
        attach_adapters(model, adapter.target_modules, adapter.rank, lora_scaling(adapter))
    _state(worker).tokenizer = load_tokenizer(worker.model_args, worker.base_dir)
    return model


def _batch_size(worker: WorkerContext) -> int:
    return worker.infer_batch_size or worker.config.batch_size


@torch.no_grad()
def generate(worker: WorkerContext, request: GenerationRequest) -> RolloutSamples:
    sampling = request.sampling
    tokenizer = _tokenizer(worker)
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids.add(tokenizer.eos_token_id)
    generator = torch.Generator(device=worker.device)
    generator.manual_seed(request.seed if request.seed is not None else worker.seed)
    prompts = [list(p) for p in request.prompt_ids for _ in range(sampling.n)]
    if not prompts or sampling.max_new_tokens < 1:
        # A rank's share of a small batch can be empty; nothing to decode either way.
        empty: list[list[int]] = [[] for _ in prompts]
        no_logprobs: list[list[float]] = [[] for _ in prompts]
        return RolloutSamples(prompt_ids=prompts, response_ids=empty, response_logprobs=no_logprobs)
    pool = _batch_size(worker) * sampling.n
    # Prompts taken shortest first (less left padding to run through the model), when they
    # do not all fit at once; the samples go back in the request's order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts) <= pool:
        order = list(range(len(prompts)))
    mode = _state(worker).decode_served = decode_mode(worker)
    routed = _returns_routing(worker, request)
    pad_id = tokenizer.pad_token_id
    # The dynamic decode records routing with hooks; the fixed-shape steps write it into
    # their decoder's slots (moe_decode).
    hooked = routed and mode == "dynamic"
    images = (
        None
        if request.images is None
        else [image for image in request.images for _ in range(sampling.n)]
    )
    if images is not None and mode != "dynamic":
        log_once(
            LOG,
            f"hf_infer: prompts with images decode with the dynamic cache: decode {mode!r} "
            "has no prefill with images yet",
            logging.WARNING,
        )
        mode = _state(worker).decode_served = "dynamic"
    with record_routing(worker.model) if hooked else contextlib.nullcontext() as record:
        decode: DynamicDecode | StaticDecode
        if record is not None:
            decode = RoutedDecode(worker.model, pad_id, worker.device, record)
        elif images is not None:
            shown = {id(prompt): image for prompt, image in zip(prompts, images)}
            decode = VisionDecode(worker.model, pad_id, worker.device, shown)
        else:
            decode = _decode(worker, mode, prompts, pool, sampling.max_new_tokens, pad_id, routed)
        responses, logprobs = sample_rows(
            decode,
            prompts,
            order,
            pool,
            sampling,
            stop_ids,
            tokenizer,
            _drawer(mode, sampling, generator),
            refill=worker.config.continuous_batching,
        )
    routing = None
    if isinstance(decode, RoutedDecode):
        routing = decode.routing(order, pool, responses)
    elif isinstance(decode, StaticDecode) and routed:
        routing = decode.routings(len(prompts))
    return RolloutSamples(
        prompt_ids=prompts,
        response_ids=responses,
        response_logprobs=logprobs,
        routing=routing,
        images=images,
    )


def _returns_routing(worker: WorkerContext, request: GenerationRequest) -> bool:
    """Whether the samples carry their routing: the request asks, or the workflow replays the
    rollout's routing (``algorithm.routing_replay: rollout``)."""
    replay = getattr(worker.algorithm, "routing_replay", "off")
    return request.return_routing or replay == "rollout"


def decode_mode(worker: WorkerContext) -> str:
    """``strategy_config.decode`` resolved: ``auto`` is ``dynamic`` on the CPU, and on a GPU
    ``cuda_graph`` until the compiled step built in the background is ready, then
    ``compiled`` (:func:`auto_mode`); a model with other than full-attention layers decodes
    dynamically."""
    mode = worker.config.decode
    on_gpu = is_cuda(worker)
    if _sharded(worker):
        if mode not in ("auto", "dynamic"):
            log_once(
                LOG,
                f"hf_infer: decode {mode!r} needs whole weights; a tensor-parallel replica "
                "decodes with the dynamic cache",
                logging.WARNING,
            )
        return "dynamic"
    if mode == "auto":
        mode = auto_mode(worker)
    if mode == "cuda_graph" and not on_gpu:
        mode = "static"  # CUDA graphs need a GPU; the same fixed-shape step runs eagerly
    if mode != "dynamic" and not supports_static(worker.model):
        log_once(
            LOG,
            f"hf_infer: {type(worker.model).__name__} has layers other than full attention: "
            "it decodes with the dynamic cache",
            logging.WARNING,
        )
        mode = "dynamic"
    return mode


# Devices where decode auto compiles in the background (on the CPU: static, then compiled); the
# CPU tests add "cpu".
BACKGROUND_COMPILE_DEVICES = ("cuda",)


def auto_mode(worker: WorkerContext) -> str:
    if torch.device(worker.device).type not in BACKGROUND_COMPILE_DEVICES:
        return "dynamic"
    job = _state(worker).compile_job
    if job is None and not compiles_in_background(
        worker.model, worker.config.decode_attention, torch.device(worker.device)
    ):
        return "compiled"
    if job is None or not job.ready:
        return "cuda_graph"
    log_once(
        LOG,
        f"hf_infer: the compiled decode step is ready ({job.seconds:.0f} s in the background): "
        "generations decode with it from now on",
        logging.INFO,
    )
    return "compiled"


def _drawer(mode: str, sampling: SamplingParams, generator: torch.Generator) -> Draw:
    """The step's sampling: fused (:func:`gumbel_draw`) in the compiled decode where the
    sampling is plain, else the general :func:`draw`."""
    if mode == "compiled" and is_plain(sampling):
        return lambda logits: gumbel_draw(logits, sampling.temperature, generator)
    return lambda logits: draw(logits, sampling, generator)


def _decode(
    worker: WorkerContext,
    mode: str,
    prompts: list[list[int]],
    pool: int,
    new_tokens: int,
    pad_id: int,
    routing: bool = False,
) -> DynamicDecode | StaticDecode:
    if mode == "dynamic":
        return DynamicDecode(worker.model, pad_id, worker.device)
    on_gpu = is_cuda(worker)
    settings = DecodeSettings(
        graph=mode in ("cuda_graph", "compiled") and on_gpu,
        compiled=mode == "compiled",
        fuse_projections=worker.config.fuse_projections,
        attention=worker.config.decode_attention,
    )
    state = _state(worker)
    decoders = state.decoders
    if decoders is None or decoders.settings != settings:
        groups = fuse_sibling_linears(worker.model) if settings.fuse_projections else []
        decoders = state.decoders = StaticDecoders(settings, groups)
    # Any prompt may come into any row: the cache holds the longest with its new tokens.
    width = max(len(p) for p in prompts)
    rows = min(pool, len(prompts))
    decoder = decoders.get(worker.model, rows, width + new_tokens, worker.device)
    if worker.config.decode == "auto" and mode != "compiled" and state.compile_job is None:
        state.compile_job = BackgroundCompile(
            worker.model, settings, decoders.groups, worker.device
        )
    return StaticDecode(decoder, pad_id, worker.device, routing)


@torch.no_grad()
def _in_chunks(
    worker: WorkerContext,
    batch: SequenceBatch,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``score(ids, mask)`` over ``logprob_micro_batch_size`` or ``micro_batch_size`` rows at a
    time when set, else ``infer_batch_size`` (or ``batch_size``), concatenated on the host."""
    parts = []
    step = worker.config.scoring_rows() or _batch_size(worker)
    for start in range(0, len(batch), step):
        ids = batch.input_ids[start : start + step].to(worker.device)
        mask = batch.attention_mask[start : start + step].to(worker.device)
        parts.append(score(ids, mask).cpu())
    return torch.cat(parts, dim=0)


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    # The chunked head multiplies by the output weight, a shard in a split replica: full logits
    # there (the model's own, gathered over the replica's ranks).
    forward: Callable[[SequenceBatch], Any] = (
        partial(forward_logits, worker.model)
        if _sharded(worker)
        else logprob_forward(worker, worker.model, train=False)
    )

    # A reference scoring the rollout's samples replays their routing (routing_replay:
    # rollout); the chunks go in order, so the next one's rows start where this one's end.
    routing = batch.tensors.get(ROUTING_KEY)
    start = 0

    with scoring_forward(worker, worker.model, forward) as routed:

        def logprobs(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            nonlocal start
            tensors = {"input_ids": ids, "attention_mask": mask}
            if routing is not None:
                tensors[ROUTING_KEY] = routing[start : start + len(ids)]
            # A vision-language model's rows keep their images (the rollout's, as they came).
            for key in IMAGE_KEYS:
                if key in batch.tensors:
                    tensors[key] = batch[key][start : start + len(ids)].to(ids.device)
            start += len(ids)
            out = routed(SequenceBatch(tensors))
            if isinstance(out, TokenLogprobs):
                return out.logprobs * mask
            return shifted_token_logprobs(out, ids) * mask

        return _in_chunks(worker, batch, logprobs)


def compute_scores(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    return _in_chunks(worker, batch, lambda ids, mask: sequence_scores(worker.model, ids, mask))


def import_weights(worker: WorkerContext, buckets: Iterable[WeightBucket]) -> bool:
    params = dict(worker.model.state_dict(keep_vars=True))
    # Synced adapters (model_args.lora.sync: adapter) land in their buffers, which the fixed-
    # shape decoders' graphs and compiled steps read in place, as they read the weights.
    adapters = adapter_buffers(worker.model)
    params.update(adapters)
    with torch.no_grad():
        for bucket in buckets:
            for name, tensor in bucket.tensors:
                if name not in params:
                    if parse_adapter_wire_name(name) is not None:
                        raise KeyError(
                            f"hf_infer: {name!r} is an adapter of a module this engine does "
                            f"not adapt (its adapted modules: {_adapted(adapters)})"
                        )
                    raise KeyError(f"hf_infer: the model has no weight named {name!r}")
                if name in adapters and tensor.shape != adapters[name].shape:
                    raise ValueError(
                        f"hf_infer: the adapter {name} came with shape {list(tensor.shape)}, "
                        f"the engine's is {list(adapters[name].shape)} (model_args.lora.rank "
                        "or the model differ from the trainer's)"
                    )
            targets = [params[name].data for name, _ in bucket.tensors]
            sources = [tensor for _, tensor in bucket.tensors]
            if _sharded(worker):
                # Whole tensors in, this rank's share of each kept.
                sources = [local_share(t, s) for t, s in zip(targets, sources)]
                targets = [local_tensor(t) for t in targets]
            if all(s.device == t.device for s, t in zip(sources, targets)):
                # One grouped copy (casting as needed) of a bucket already on the device (the
                # in-process hand-over): per-tensor copies cost more in launches than in bytes.
                torch._foreach_copy_(targets, sources)
            else:
                for target, source in zip(targets, sources):
                    target.copy_(source)
    return True


def _adapted(adapters: dict[str, torch.Tensor]) -> str:
    """The adapted modules of :func:`adapter_buffers`' names, a few of them, for a message."""
    modules = sorted({name.rsplit(".", 2)[0] for name in adapters})
    return ", ".join(modules[:4]) + (", ..." if len(modules) > 4 else "") if modules else "none"


def weight_shapes(worker: WorkerContext) -> dict[str, tuple[int, ...]]:
    """What a sync may send: the model's tensors by name, each whole (a split replica's
    DTensors report their global shapes), and the synced adapters' when it has them."""
    shapes = {name: tuple(t.shape) for name, t in worker.model.state_dict().items()}
    shapes.update({name: tuple(t.shape) for name, t in adapter_buffers(worker.model).items()})
    return shapes


def save_checkpoint(worker: WorkerContext, path: str) -> dict[str, str]:
    # An inference engine has no optimizer state; its weights are what a sync put there.
    sharded = _sharded(worker)
    if worker.rank == 0 or sharded:  # every rank of a sharded replica gathers
        from safetensors.torch import save_file

        state = whole_state(worker.model)
        # The synced adapters under their wire names: load_checkpoint imports them as a sync.
        state.update(
            {n: t.detach().cpu().clone() for n, t in adapter_buffers(worker.model).items()}
        )
        if worker.rank == 0:
            os.makedirs(path, exist_ok=True)
            save_file(unshare_storage(state.items()), os.path.join(path, "model.safetensors"))
    return {"format": "safetensors"}


def whole_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state on the host, whole (a tensor-parallel share gathered: every rank of
    the replica must call)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_share(target: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``whole`` for ``target``: as the target's placement on its 1-D
    mesh splits it (``torch.chunk`` along a sharded dimension, as DTensor does), or all of it."""
    if not isinstance(target, DTensor):
        return whole
    (placement,) = target.placements
    if isinstance(placement, Shard):
        mesh = target.device_mesh
        return torch.chunk(whole, mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return whole


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, "model.safetensors"))
    return import_weights(worker, [WeightBucket(list(state.items()))])


def export_hf(worker: WorkerContext, path: str) -> bool:
    state = whole_state(worker.model) if _sharded(worker) else None
    if adapter_buffers(worker.model):
        # A plain HF model of the policy: the adapters merged into their weights.
        state = merged_state(worker.model, worker.model.state_dict())
    if worker.rank == 0:
        with no_hf_progress_bars():
            worker.model.save_pretrained(path, safe_serialization=True, state_dict=state)
        _tokenizer(worker).save_pretrained(path)
    return True


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    """Move the weights to host memory while a colocated role uses the device, when the
    config says so (``param_offload``; the memory plan resolves ``auto`` before the run)."""
    if worker.config.param_offload is True and "weights" in memory_tags(tags):
        # Captured decode graphs point at the weights' device memory, which the move frees;
        # stacked projections would keep a device copy (they are stacked again after). A
        # compile in the background must not run its step on weights being moved: it stops,
        # and the next generation starts another (a finished one stays: its code serves).
        state = _state(worker)
        if state.compile_job is not None and not state.compile_job.ready:
            state.compile_job.stop()
            state.compile_job = None
        state.decoders = None
        unfuse_sibling_linears(worker.model)
        if is_cuda(worker):
            weights_to_host(worker.model, _state(worker).pinned)
            torch.cuda.empty_cache()
        else:
            worker.model.to("cpu")
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if worker.config.param_offload is True and "weights" in memory_tags(tags):
        if is_cuda(worker):
            weights_to_device(worker.model, worker.device)
        else:
            worker.model.to(worker.device)
    return True


def _model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied one once) and buffer, by name."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def weights_to_host(model: torch.nn.Module, pinned: dict[str, torch.Tensor]) -> None:
    """Each weight's data into a page-locked host buffer, kept for the next release: a copy at
    the host link's speed (``model.to("cpu")`` into fresh pageable memory moved an 8B model at
    1.3 GB/s, 12 s a step on an H200)."""
    moved = []
    for name, tensor in _model_tensors(model):
        if tensor.device.type != "cuda":
            continue
        host = pinned.get(name)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = pinned[name] = torch.empty(
                tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True
            )
        host.copy_(tensor.data, non_blocking=True)
        moved.append((tensor, host))
    torch.cuda.synchronize()  # the copies land before the device memory is let go
    for tensor, host in moved:
        tensor.data = host


def weights_to_device(model: torch.nn.Module, device: str | torch.device) -> None:
    """The weights back from their page-locked host buffers (which stay for the next release)."""
    for _name, tensor in _model_tensors(model):
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.to(device, non_blocking=True)
    torch.cuda.synchronize()


def shutdown_worker(worker: WorkerContext) -> bool:
    state = _state(worker)
    if state.compile_job is not None:
        # A daemon thread: neither the shutdown nor the process's exit waits for it.
        state.compile_job.stop(wait=False)
    if state.tp_mesh is not None:
        state.tp_mesh = None
        end_process_group()
    return True
