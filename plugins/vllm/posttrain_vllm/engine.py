"""Engine side of the ``vllm`` strategy: one vLLM ``LLM`` per data-parallel replica.

Reported log-probs are those of the model's own distribution (temperature 1, before top-k/top-p):
the engine runs with ``logprobs_mode="raw_logprobs"``, so they compare directly with a trainer's
forward pass, as ``hf_infer``'s do.

Weight import: with the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default
here) the tensors go straight to the worker through ``collective_rpc("reload_weights",
weights_iterator=...)``. With the multiprocessing engine tensors do not survive the RPC, so each
bucket is written as safetensors into a tmpfs directory and loaded with ``weights_path=``.

Adapter-only syncs (``model_args.lora.sync: adapter``, :func:`posttrain.backend.synced_adapter`):
the engine starts with vLLM's LoRA support and keeps its base weights; each sync's ``lora_A`` /
``lora_B`` tensors are written as a peft adapter into a fresh tmpfs directory and registered as
a new ``LoRARequest``, which every later generate and scoring call uses (the previous one is
removed from the engine, and its directory with it).

Hybrid engine: beside a trainer in the same rank processes, the trainer has already made the
process group, and vLLM's own single-process world cannot be made next to it. The engine then
runs with vLLM's ``external_launcher`` executor (as verl's does): vLLM takes the existing world
as its outer data-parallel dimension, each rank a replica of its own, and the ``in_process``
transport hands the trainer's tensors to ``reload_weights`` without a copy through host memory.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain import (
    GenerationRequest,
    RolloutSamples,
    SequenceBatch,
    UserError,
    WeightBucket,
    unknown_keys,
)
from posttrain.backend import (
    drain,
    is_cuda,
    leads_replica,
    load_tokenizer,
    parse_adapter_wire_name,
    resolve_model_path,
    synced_adapter,
    tensor_parallel_replicas,
    unshare_storage,
)
from posttrain_vllm import worker_side

if TYPE_CHECKING:
    import vllm
    from transformers import PreTrainedTokenizerBase
    from vllm.lora.request import LoRARequest

    from posttrain import LoraArgs, SamplingParams, WorkerContext

log = logging.getLogger("posttrain.vllm")

CPU_KV_CACHE_BYTES = 64 << 20
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@attrs.define(kw_only=True)
class VLLMState:
    """What a rank keeps between calls (``worker.engine_state(VLLMState)``)."""

    tokenizer: PreTrainedTokenizerBase | None = None  # set by load_model, on every rank
    # The replica's engine; None on the other ranks of a replica and after shutdown.
    engine: vllm.LLM | None = None
    # The engine joined the trainer's world (external_launcher): shutdown leaves it standing.
    external_world: bool = False
    # The engine loaded a tokenizer (it matches stop strings).
    has_tokenizer: bool = False
    # The tmpfs directory buckets pass through to a multiprocessing engine.
    shm_dir: str | None = None
    cpu_sleep_warned: bool = False
    # Adapter-only syncs: the adapter of the latest sync, which every request carries (None
    # before the first sync: the base alone is the policy then), and its tmpfs directory.
    lora: LoRARequest | None = None
    lora_dir: str | None = None
    lora_syncs: int = 0


def _state(worker: WorkerContext) -> VLLMState:
    return worker.engine_state(VLLMState)


def _tokenizer(worker: WorkerContext) -> PreTrainedTokenizerBase:
    tokenizer = _state(worker).tokenizer
    if tokenizer is None:
        raise RuntimeError("vllm: the tokenizer is loaded with the model (load_model)")
    return tokenizer


def multiprocessing_engine() -> bool:
    """Whether vLLM runs its engine core in a separate process (env ``VLLM_ENABLE_V1_...``)."""
    return os.environ.get(_MP_ENV, "0").strip().lower() in ("1", "true")


def beside_another_role() -> bool:
    """Whether another role of this rank process (a trainer) already made the process group:
    vLLM must then join that world (``external_launcher``) instead of making its own."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------
# setup and loading
# ---------------------------------------------------------------------------------------------


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    """Ranks ``[k*tp, (k+1)*tp)`` form replica ``k``; its first rank drives one engine that
    spans the replica's GPUs (vLLM tensor parallelism). The other ranks of a replica idle."""
    tp = worker.config.tensor_parallel_size
    return tensor_parallel_replicas(worker, tp, "tensor_parallel_size")


def engine_args(worker: WorkerContext) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for this worker (before ``engine_kwargs``)."""
    cfg = worker.config
    path = resolve_model_path(worker.model_args.model_name_or_path, worker.base_dir)
    dtype = cfg.dtype or worker.model_args.dtype
    args: dict[str, Any] = {
        "model": path,
        "dtype": _DTYPES.get(dtype, dtype),
        "seed": worker.seed if cfg.seed is None else cfg.seed,
        "enforce_eager": cfg.enforce_eager,
        "load_format": cfg.load_format,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        # Prompts arrive as token ids: the engine needs a tokenizer only to match stop strings
        # (transformers 5 may reload a local tokenizer with another vocabulary: see
        # _check_engine_tokenizer).
        "skip_tokenizer_init": not _stop_strings(worker),
        # Log-probs of the model's own distribution, before temperature / top-k / top-p.
        "logprobs_mode": "raw_logprobs",
        "trust_remote_code": worker.model_args.trust_remote_code,
        # Weight import (and re-tying a tied LM head) runs in the worker through this.
        "worker_extension_cls": worker_side.EXTENSION,
    }
    if beside_another_role():
        args["distributed_executor_backend"] = "external_launcher"
    if cfg.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    elif not is_cuda(worker):
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if cfg.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.max_model_len is not None:
        args["max_model_len"] = cfg.max_model_len
    if cfg.enable_prefix_caching is not None:
        args["enable_prefix_caching"] = cfg.enable_prefix_caching
    if _sleep_mode(worker):
        args["enable_sleep_mode"] = True
    if worker.model_args.tokenizer_name_or_path:
        args["tokenizer"] = resolve_model_path(
            worker.model_args.tokenizer_name_or_path, worker.base_dir
        )
    adapter = synced_adapter(worker)
    if adapter is not None:
        args["enable_lora"] = True
        args["max_lora_rank"] = max_lora_rank(adapter.rank)
        # One adapter in use at a time; room for two so a sync registers the new one before
        # it removes the old one (the LRU cache would otherwise evict it behind our back).
        args["max_loras"] = 1
        args["max_cpu_loras"] = 2
    return args


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (a fixed set of values) that fits ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(get_args(MaxLoRARanks))
    for value in allowed:
        if value >= rank:
            return value
    raise UserError(
        f"vllm: LoRA rank {rank} is above the largest max_lora_rank vLLM takes ({allowed[-1]}); "
        "use a smaller model_args.lora.rank or model_args.lora.sync: merged"
    )


def _stop_strings(worker: WorkerContext) -> list[str]:
    gen = worker.generating_args
    return list(gen.stop_strings) if gen else []


def _check_engine_tokenizer(worker: WorkerContext, llm: vllm.LLM) -> None:
    """Stop strings are matched on the engine's detokenized text: its tokenizer must be the
    one posttrain decodes with."""
    ours = _tokenizer(worker).get_vocab()
    if llm.get_tokenizer().get_vocab() != ours:
        raise UserError(
            "vllm: the engine loaded a tokenizer whose vocabulary differs from the model's "
            "(needed for generating_args.stop_strings); set model_args.tokenizer_name_or_path"
        )


def _sleep_mode(worker: WorkerContext) -> bool:
    enabled = worker.config.enable_sleep_mode
    return is_cuda(worker) if enabled is None else bool(enabled)


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Unknown ``engine_kwargs`` keys: a clear error naming them and close matches."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise UserError(
            "vllm: strategy_config.engine_kwargs has keys vLLM's EngineArgs does not accept: "
            + unknown_keys(unknown, known)
        )


def check_cpu_head_size(path: str) -> None:
    """vLLM's CPU attention kernels exist for some head sizes only (none below 32); say so
    before the engine fails deep inside its first forward pass."""
    if not os.path.isdir(path):
        return
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = AutoConfig.from_pretrained(path)
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or (heads and cfg.hidden_size // heads)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim and head_dim not in supported:
        raise UserError(
            f"vllm: the model's attention head size is {head_dim} (hidden_size "
            f"{cfg.hidden_size} / {heads} heads); vLLM's CPU attention supports {supported}. "
            "Use a model with another head size (e.g. preset:tiny-qwen2-head32) or another "
            "strategy."
        )


def load_model(worker: WorkerContext) -> vllm.LLM | dict[str, bool]:
    _state(worker).tokenizer = load_tokenizer(worker.model_args, worker.base_dir)
    if not leads_replica(worker):
        return {"replica_leader": False}
    os.environ.setdefault(_MP_ENV, "0")
    if beside_another_role() and multiprocessing_engine():
        raise UserError(
            "vllm: beside another role in the same processes (cluster.colocation: auto) the "
            f"engine runs in-process; unset {_MP_ENV} or set cluster.colocation: separate"
        )
    if is_cuda(worker) and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # The leader drives the replica's GPUs: its own and the next tp - 1. (A launcher that
        # already narrowed the visible devices, as Ray does, is left alone.)
        first = int(os.environ.get("LOCAL_RANK", "0"))
        tp = worker.config.tensor_parallel_size
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(tp))
    _check_adapter_sleep(worker)
    args = engine_args(worker)
    if not is_cuda(worker):
        check_cpu_head_size(args["model"])
        if worker.config.enforce_eager:
            _eager_sampler()
    extra = dict(worker.config.engine_kwargs)
    check_engine_kwargs(extra)
    args.update(extra)
    threads = torch.get_num_threads()
    from vllm import LLM

    started = time.monotonic()
    try:
        llm = LLM(**args)
    except (TypeError, ValueError) as exc:
        raise UserError(f"vllm: the engine rejected its arguments: {exc}") from exc
    finally:
        # vLLM drops torch to one thread in-process; give the rank back its setting.
        _restore_threads(threads)
    state = _state(worker)
    state.engine = llm  # before the check below, so that shutdown stops it
    state.external_world = args.get("distributed_executor_backend") == "external_launcher"
    state.has_tokenizer = not args["skip_tokenizer_init"]
    if state.has_tokenizer:
        _check_engine_tokenizer(worker, llm)
    adapter = synced_adapter(worker)
    if adapter is not None:
        _check_lora_targets(llm, adapter)
    log.info(
        "vLLM %s engine ready in %.1fs",
        "multiprocess" if multiprocessing_engine() else "in-process",
        time.monotonic() - started,
    )
    return llm


def _check_adapter_sleep(worker: WorkerContext) -> None:
    """Sleep level 2 discards the base weights and expects the next sync to resend them; an
    adapter-only sync never does."""
    if (
        synced_adapter(worker) is not None
        and _sleep_mode(worker)
        and worker.config.sleep_level == 2
    ):
        raise UserError(
            "vllm: strategy_config.sleep_level 2 discards the base weights, which adapter-only "
            "syncs (model_args.lora.sync: adapter) do not resend; use sleep_level: 1 or "
            "model_args.lora.sync: merged"
        )


def _check_lora_targets(llm: vllm.LLM, adapter: LoraArgs) -> None:
    """Every LoRA target must be a module vLLM's LoRA applies to on this model (vLLM would
    only refuse the adapter at the first sync)."""
    supported = set.intersection(
        *(set(names) for names in llm.collective_rpc("posttrain_lora_modules"))
    )
    missing = sorted(set(adapter.target_modules) - supported)
    if missing:
        raise UserError(
            f"vllm: model_args.lora.target_modules {missing} are modules vLLM's LoRA does not "
            f"apply to on this model (it takes {sorted(supported)}); drop them, or set "
            "model_args.lora.sync: merged to sync merged weights instead"
        )


def _eager_sampler() -> None:
    """``enforce_eager`` leaves a few of vLLM's sampler helpers under ``torch.compile``; on CPU
    compiling them takes seconds of the first rollouts, for element-wise work over the
    vocabulary. Run them eagerly: in this process, and in an engine process started from it."""
    import torch._dynamo

    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch._dynamo.config.disable = True


def _restore_threads(threads: int) -> None:
    with suppress(Exception):  # vLLM may have made it a no-op
        torch.set_num_threads(threads)


def _llm(worker: WorkerContext) -> vllm.LLM | None:
    return _state(worker).engine


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------


def _batch_size(worker: WorkerContext) -> int | None:
    return worker.infer_batch_size


def _request_seed(seed: int | None, index: int, n: int) -> int | None:
    """A distinct, reproducible seed per prompt of a request. vLLM gives the ``n`` samples of a
    prompt ``seed + j``, so the prompts' seeds are ``n`` apart."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * n) % (2**62)


def sampling_params(
    worker: WorkerContext, sampling: SamplingParams, seed: int | None, **extra: Any
) -> vllm.SamplingParams:
    import vllm

    eos = None if sampling.ignore_eos else _tokenizer(worker).eos_token_id
    stop = list(dict.fromkeys([*sampling.stop_token_ids, *([eos] if eos is not None else [])]))
    if sampling.stop and not _state(worker).has_tokenizer:
        raise UserError(
            "vllm: this request has stop strings but the engine was started without a "
            "tokenizer; list them in the role's generating_args.stop_strings"
        )
    return vllm.SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=stop,
        ignore_eos=sampling.ignore_eos,
        # vLLM keeps the token completing a stop string (and its log-prob) in token_ids.
        stop=list(sampling.stop),
        logprobs=0,  # the sampled token's log-prob only
        seed=seed,
        # Text is only needed to match stop strings.
        detokenize=bool(sampling.stop),
        **extra,
    )


def generate(worker: WorkerContext, request: GenerationRequest) -> RolloutSamples:
    out = RolloutSamples(prompt_ids=[], response_ids=[], response_logprobs=[])
    llm = _llm(worker)
    if llm is None:  # a non-leader rank of a tensor-parallel replica
        return out
    from vllm.inputs import TokensPrompt

    prompts = [list(p) for p in request.prompt_ids]
    params = [
        sampling_params(
            worker, request.sampling, _request_seed(request.seed, i, request.sampling.n)
        )
        for i in range(len(prompts))
    ]
    step = _batch_size(worker) or len(prompts) or 1
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in chunk],
            params[start : start + step],
            use_tqdm=False,
            lora_request=_state(worker).lora,
        )
        for prompt, result in zip(chunk, results):
            for completion in sorted(result.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                logprobs = completion.logprobs or []
                out.prompt_ids.append(prompt)
                out.response_ids.append(ids)
                out.response_logprobs.append(
                    [float(lp[tok].logprob) for tok, lp in zip(ids, logprobs)]
                )
    return out


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    """Log-probs of given sequences through vLLM's prompt log-probs (one token generated)."""
    result = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    llm = _llm(worker)
    if llm is None:
        return result
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = batch.sequences()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    step = _batch_size(worker) or len(prompts) or 1
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in chunk],
            params,
            use_tqdm=False,
            lora_request=_state(worker).lora,
        )
        for row, (ids, o) in enumerate(zip(chunk, outs), start=start):
            for t in range(1, len(ids)):
                result[row, t] = float(o.prompt_logprobs[t][ids[t]].logprob)
    return result


# ---------------------------------------------------------------------------------------------
# weight sync
# ---------------------------------------------------------------------------------------------


def _shm_dir(worker: WorkerContext) -> str:
    state = _state(worker)
    path = state.shm_dir
    if path is None:
        path = state.shm_dir = tempfile.mkdtemp(
            prefix=f"posttrain-vllm-{os.getpid()}-", dir=_tmpfs()
        )
    return path


def _tmpfs() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def import_weights(worker: WorkerContext, buckets: Iterable[WeightBucket]) -> bool:
    llm = _llm(worker)
    if llm is None:
        return drain(buckets)
    adapter = synced_adapter(worker)
    if adapter is not None:
        _import_adapter(worker, llm, adapter, buckets)
        return True
    via_files = multiprocessing_engine() or worker.config.tensor_parallel_size > 1
    for bucket in buckets:
        tensors = [(name, t.detach()) for name, t in bucket.tensors]
        if not tensors:
            continue
        retie = any(name in _EMBED_NAMES for name, _ in tensors)
        if via_files:
            _reload_from_files(worker, llm, tensors, retie)
        else:
            llm.collective_rpc(
                "posttrain_reload_weights",
                kwargs={"weights_iterator": tensors, "retie": retie},
            )
    # Cached prefixes hold keys/values of the old weights.
    llm.reset_prefix_cache()
    return True


def _reload_from_files(
    worker: WorkerContext, llm: vllm.LLM, tensors: list[tuple[str, torch.Tensor]], retie: bool
) -> None:
    from safetensors.torch import save_file

    folder = _shm_dir(worker)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    state = unshare_storage((name, t.contiguous().cpu()) for name, t in tensors)
    save_file(state, os.path.join(folder, "bucket.safetensors"))
    try:
        llm.collective_rpc(
            "posttrain_reload_weights", kwargs={"weights_path": folder, "retie": retie}
        )
    finally:
        os.remove(os.path.join(folder, "bucket.safetensors"))


def _import_adapter(
    worker: WorkerContext, llm: vllm.LLM, adapter: LoraArgs, buckets: Iterable[WeightBucket]
) -> None:
    """An adapter-only sync: the base weights stay; the sync's adapters become a new
    ``LoRARequest`` (a peft adapter directory on tmpfs) that replaces the previous one."""
    from vllm.lora.request import LoRARequest

    # Host copies: the buckets' tensors may be the trainer's own, reused after this call.
    tensors = {name: t.detach().to("cpu", copy=True) for b in buckets for name, t in b.tensors}
    if not tensors:
        return
    state = _state(worker)
    version = state.lora_syncs + 1
    folder = tempfile.mkdtemp(prefix=f"posttrain-vllm-{os.getpid()}-lora{version}-", dir=_tmpfs())
    try:
        write_peft_adapter(folder, tensors, adapter)
        request = LoRARequest(f"posttrain-policy-{version}", version, folder)
        try:
            llm.llm_engine.add_lora(request)
        except ValueError as exc:  # vLLM refusing the adapter (modules, rank, format)
            raise UserError(
                f"vllm: the engine refused the synced LoRA adapters: {exc}; set "
                "model_args.lora.sync: merged to sync merged weights instead"
            ) from exc
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    previous, old_dir = state.lora, state.lora_dir
    state.lora, state.lora_dir, state.lora_syncs = request, folder, version
    if previous is not None:
        llm.llm_engine.remove_lora(previous.lora_int_id)
    if old_dir is not None:
        shutil.rmtree(old_dir, ignore_errors=True)


def write_peft_adapter(folder: str, tensors: dict[str, torch.Tensor], adapter: LoraArgs) -> None:
    """``tensors`` (wire names, :func:`posttrain.backend.parse_adapter_wire_name`) as peft's
    saved adapter: ``adapter_model.safetensors`` under ``base_model.model.<module>.lora_A.
    weight`` etc., and ``adapter_config.json`` (what vLLM's loader reads)."""
    import json

    from safetensors.torch import save_file

    saved: dict[str, torch.Tensor] = {}
    parts: dict[str, set[str]] = {}
    for name, tensor in tensors.items():
        parsed = parse_adapter_wire_name(name)
        if parsed is None:
            raise RuntimeError(
                f"vllm: an adapter-only sync carried {name!r}, which is not a LoRA adapter; "
                "the trainer and the rollout role disagree on model_args.lora.sync"
            )
        module, part = parsed
        parts.setdefault(module, set()).add(part)
        saved[f"base_model.model.{module}.lora_{part}.weight"] = tensor.contiguous()
    halves = sorted(m for m, p in parts.items() if p != {"A", "B"})
    if halves:
        raise RuntimeError(f"vllm: the sync carried one half of the adapters of {halves[:5]}")
    save_file(saved, os.path.join(folder, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": sorted(adapter.target_modules),
        "bias": "none",
    }  # vLLM scales the product by lora_alpha / r, as the trainer does
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


# ---------------------------------------------------------------------------------------------
# memory lifecycle and shutdown
# ---------------------------------------------------------------------------------------------


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    llm = _llm(worker)
    if llm is None:
        return True
    if not _sleep_mode(worker):
        _warn_no_sleep(worker)
        return True
    llm.sleep(level=worker.config.sleep_level)
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    llm = _llm(worker)
    if llm is None or not _sleep_mode(worker):
        return True
    wake = [t for t in tags if t in ("weights", "kv_cache")]
    llm.wake_up(tags=wake or None)
    if not wake or "kv_cache" in wake:
        llm.reset_prefix_cache()
    return True


def _warn_no_sleep(worker: WorkerContext) -> None:
    state = _state(worker)
    if state.cpu_sleep_warned:
        return
    state.cpu_sleep_warned = True
    reason = "vLLM has no sleep mode on CPU" if not is_cuda(worker) else "sleep mode is off"
    log.warning("%s: release/resume memory keeps the engine as it is", reason)


def shutdown_worker(worker: WorkerContext) -> bool:
    state = _state(worker)
    llm, state.engine = state.engine, None
    if llm is not None:
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            try:
                engine_core.shutdown()
            except Exception as exc:
                log.warning("vLLM engine shutdown: %s", exc)
        del llm
        worker.model = None
        gc.collect()
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            external_world, state.external_world = state.external_world, False
            if not external_world:
                # The world is vLLM's own; beside a trainer it is the trainer's, left to it.
                destroy_distributed_environment()
        except Exception as exc:
            log.debug("vLLM distributed teardown: %s", exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    state.lora = None
    for folder in (state.shm_dir, state.lora_dir):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    state.shm_dir = state.lora_dir = None
    return True
