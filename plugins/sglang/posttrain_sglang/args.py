"""SGLang ``Engine`` arguments for one rank, and the check of ``engine_kwargs``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain import UserError, unknown_keys
from posttrain.backend import resolve_model_path

if TYPE_CHECKING:
    from posttrain import WorkerContext

# KV-cache tokens on CPU when max_total_tokens is unset: uncapped, SGLang sizes its cache from
# host memory (14.7 GB measured for a 2-layer model).
CPU_MAX_TOTAL_TOKENS = 4096
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}


def device_type(worker: WorkerContext) -> str:
    """``cpu`` or ``cuda``: the config's ``device``, else the role's."""
    return worker.config.device or ("cuda" if worker.device.startswith("cuda") else "cpu")


def is_cuda(worker: WorkerContext) -> bool:
    return device_type(worker) == "cuda"


def stop_strings(worker: WorkerContext) -> list[str]:
    gen = worker.generating_args
    return list(gen.stop_strings) if gen else []


def memory_saver(worker: WorkerContext) -> bool:
    """Whether the engine can release and resume memory (torch_memory_saver; GPUs only)."""
    enabled = worker.config.enable_memory_saver
    return is_cuda(worker) if enabled is None else bool(enabled)


def engine_args(worker: WorkerContext) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine`` for this worker (before ``engine_kwargs``)."""
    cfg = worker.config
    dtype = cfg.dtype or worker.model_args.dtype
    args: dict[str, Any] = {
        "model_path": resolve_model_path(worker.model_args.model_name_or_path, worker.base_dir),
        "dtype": _DTYPES.get(dtype, dtype),
        "tp_size": cfg.tp_size,
        "random_seed": worker.seed if cfg.random_seed is None else cfg.random_seed,
        "device": device_type(worker),
        "trust_remote_code": worker.model_args.trust_remote_code,
        # Prompts arrive as token ids: the engine needs a tokenizer only to match stop strings
        # (and transformers 5 may load a local tokenizer with another vocabulary: see
        # engine.check_engine_tokenizer).
        "skip_tokenizer_init": not stop_strings(worker),
        # An in-process engine serves no HTTP traffic: nothing to warm up.
        "skip_server_warmup": True,
        # SGLang logs every batch at "info"; the rank's log keeps warnings and errors.
        "log_level": "warning",
    }
    if worker.model_args.tokenizer_name_or_path:
        args["tokenizer_path"] = resolve_model_path(
            worker.model_args.tokenizer_name_or_path, worker.base_dir
        )
    if cfg.max_total_tokens is not None:
        args["max_total_tokens"] = cfg.max_total_tokens
    elif not is_cuda(worker):
        args["max_total_tokens"] = CPU_MAX_TOTAL_TOKENS
    if cfg.attention_backend is not None:
        args["attention_backend"] = cfg.attention_backend
    elif not is_cuda(worker):
        # SGLang's CPU default on x86 ("intel_amx") needs sgl_kernel's CPU ops: not installable.
        args["attention_backend"] = "torch_native"
    if cfg.mem_fraction_static is not None:
        args["mem_fraction_static"] = cfg.mem_fraction_static
    if cfg.context_length is not None:
        args["context_length"] = cfg.context_length
    if memory_saver(worker):
        args["enable_memory_saver"] = True
    if is_cuda(worker):
        # The replica's GPUs: this rank's and the next tp_size - 1.
        args["base_gpu_id"] = worker.local_rank
    return args


def server_args_fields() -> set[str]:
    from sglang.srt.server_args import ServerArgs

    return set(ServerArgs.__struct_fields__)


def owned_keys() -> set[str]:
    """ServerArgs fields that strategy_config (or the plugin) sets: not for engine_kwargs."""
    import attrs

    from posttrain_sglang.config import SGLangConfig

    return {f.name for f in attrs.fields(SGLangConfig)} - {"engine_kwargs"} | {"model_path"}


def check_engine_kwargs(kwargs: dict[str, Any], known: set[str] | None = None) -> None:
    """Unknown ``engine_kwargs`` keys: a clear error naming them and close matches; keys that
    ``strategy_config`` has a field for: an error pointing there."""
    owned = sorted(set(kwargs) & owned_keys())
    if owned:
        raise UserError(
            "sglang: set " + ", ".join(repr(k) for k in owned) + " in strategy_config (or "
            "model_args), not in strategy_config.engine_kwargs"
        )
    known = server_args_fields() if known is None else known
    unknown = sorted(set(kwargs) - known)
    if not unknown:
        return
    raise UserError(
        "sglang: strategy_config.engine_kwargs has keys SGLang's ServerArgs does not accept: "
        + unknown_keys(unknown, known)
    )
