"""Engine side of the ``sglang`` strategy: one in-process SGLang ``Engine`` per data-parallel
replica, driven by the replica's first rank.

Reported log-probs are those of the model's own distribution (temperature 1, before top-k/top-p):
the engine runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, so they compare directly with a
trainer's forward pass, as ``hf_infer``'s and ``vllm``'s do.

Weight import, both through ``begin_weight_update`` / ``end_weight_update`` and a cache flush:
beside the trainer in its process (``in_process`` transport: the trainer's tensors, CUDA IPC
handles on GPU) or colocated (``shared_memory`` transport: the buckets arrive on the rank) they
go to the scheduler with ``update_weights_from_tensor``; on separate devices (``broadcast``
transport) the scheduler receives them itself (:mod:`posttrain_sglang.receiver`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from posttrain import GenerationRequest, RolloutSamples, SequenceBatch, UserError, WeightBucket
from posttrain.backend import drain, leads_replica, load_tokenizer, tensor_parallel_replicas
from posttrain_sglang import args as engine_args_mod
from posttrain_sglang import calls, leftovers
from posttrain_sglang.receiver import DistributedReceiver
from posttrain_sglang.state import rank_state, tokenizer

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine

    from posttrain import SamplingParams, WorkerContext

log = logging.getLogger("posttrain.sglang")

# Engine calls that need no peer; the broadcast path uses the transport's timeout instead.
LOCAL_CALL_TIMEOUT_S = 300.0
# Environment of the engine's processes (set before SGLang is imported; its children inherit it).
_ENV = {
    # Log-probs of the model's distribution before temperature / top-k / top-p (SGLang's default
    # reports them after temperature).
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
}


# ---------------------------------------------------------------------------------------------
# setup and loading
# ---------------------------------------------------------------------------------------------


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    """Ranks ``[k*tp, (k+1)*tp)`` form replica ``k``; its first rank drives one engine that
    spans the replica's GPUs (SGLang tensor parallelism). The other ranks of a replica idle."""
    tp = worker.config.tp_size
    return tensor_parallel_replicas(worker, tp, "tp_size")


def load_model(worker: WorkerContext) -> Engine | dict[str, bool]:
    rank_state(worker).tokenizer = load_tokenizer(worker.model_args, worker.base_dir)
    if not leads_replica(worker):
        return {"replica_leader": False}
    args = engine_args_mod.engine_args(worker)
    extra = dict(worker.config.engine_kwargs)
    engine_args_mod.check_engine_kwargs(extra)
    args.update(extra)
    if not engine_args_mod.is_cuda(worker):
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ.update(_ENV)
    from sglang.srt.entrypoints.engine import Engine

    rank_state(worker).shm_before = leftovers.shm_snapshot()
    started = time.monotonic()
    try:
        engine = Engine(**args)
    except (TypeError, ValueError) as exc:
        raise UserError(f"sglang: the engine rejected its arguments: {exc}") from exc
    log.info("SGLang engine ready in %.1fs", time.monotonic() - started)
    rank_state(worker).engine = engine
    if not args["skip_tokenizer_init"]:
        check_engine_tokenizer(worker, engine)
    return engine


def check_engine_tokenizer(worker: WorkerContext, engine: Engine) -> None:
    """Stop strings are matched on the engine's detokenized text: its tokenizer must be the one
    posttrain decodes with."""
    theirs = engine.tokenizer_manager.tokenizer
    if theirs is None or theirs.get_vocab() != tokenizer(worker).get_vocab():
        raise UserError(
            "sglang: the engine loaded a tokenizer whose vocabulary differs from the model's "
            "(needed for generating_args.stop_strings); set model_args.tokenizer_name_or_path"
        )


def _engine(worker: WorkerContext) -> Engine | None:
    engine = rank_state(worker).engine
    if engine is not None:
        calls.check_usable(worker)
    return engine


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------


def _batch_size(worker: WorkerContext) -> int | None:
    return worker.infer_batch_size


def _sample_seed(seed: int | None, prompt: int, sample: int, n: int) -> int | None:
    """A distinct, reproducible seed per sample of a request (SGLang uses it with
    ``enable_deterministic_inference``; otherwise the engine's own RNG decides)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + prompt * n + sample) % (2**62)


def sampling_params(worker: WorkerContext, sampling: SamplingParams) -> dict[str, Any]:
    eos = None if sampling.ignore_eos else tokenizer(worker).eos_token_id
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *([eos] if eos is not None else [])]))
    params: dict[str, Any] = {
        "n": 1,  # the plugin repeats each prompt n times (one seed per sample)
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": stop_ids,
        "ignore_eos": sampling.ignore_eos,
    }
    stop = list(sampling.stop)
    if stop:
        if engine_has_no_tokenizer(worker):
            raise UserError(
                "sglang: stop strings need the engine's tokenizer; set generating_args."
                "stop_strings in the workflow (the engine then loads one)"
            )
        params["stop"] = stop
    return params


def engine_has_no_tokenizer(worker: WorkerContext) -> bool:
    """Whether this rank drives an engine started without a tokenizer."""
    engine = rank_state(worker).engine
    return engine is not None and engine.tokenizer_manager.tokenizer is None


def generate(worker: WorkerContext, request: GenerationRequest) -> RolloutSamples:
    out = RolloutSamples(prompt_ids=[], response_ids=[], response_logprobs=[])
    engine = _engine(worker)
    if engine is None:  # a non-leader rank of a tensor-parallel replica
        return out
    n = request.sampling.n
    base = sampling_params(worker, request.sampling)
    prompts = [list(p) for p in request.prompt_ids]
    step = _batch_size(worker) or len(prompts) or 1
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        input_ids = [p for p in chunk for _ in range(n)]
        params = [
            {**base, "sampling_seed": _sample_seed(request.seed, start + i, j, n)}
            for i in range(len(chunk))
            for j in range(n)
        ]
        results = engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
        for prompt, result in zip(input_ids, results):
            ids = list(result["output_ids"])
            logprobs = [float(lp) for lp, *_ in result["meta_info"]["output_token_logprobs"]]
            if len(logprobs) != len(ids):
                raise RuntimeError(
                    f"sglang returned {len(ids)} tokens but {len(logprobs)} log-probs"
                )
            out.prompt_ids.append(prompt)
            out.response_ids.append(ids)
            out.response_logprobs.append(logprobs)
    return out


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    """Log-probs of given sequences: SGLang's input-token log-probs (one token generated)."""
    result = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    engine = _engine(worker)
    if engine is None:
        return result
    rows = batch.sequences()
    params = {"max_new_tokens": 1, "temperature": 0.0}
    step = _batch_size(worker) or len(rows) or 1
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        outs = engine.generate(
            input_ids=chunk, sampling_params=params, return_logprob=True, logprob_start_len=0
        )
        for row, (ids, o) in enumerate(zip(chunk, outs), start=start):
            scored = o["meta_info"]["input_token_logprobs"]
            for t in range(1, len(ids)):
                result[row, t] = float(scored[t][0])
    return result


# ---------------------------------------------------------------------------------------------
# weight sync
# ---------------------------------------------------------------------------------------------


def import_weights(worker: WorkerContext, buckets: Iterable[WeightBucket]) -> bool:
    """Colocated path: every bucket of this call inside one weight-update session."""
    engine = _engine(worker)
    if engine is None:
        return drain(buckets)
    tensors = [(name, t.detach()) for bucket in buckets for name, t in bucket.tensors]
    if not tensors:
        return True
    with calls.weight_update(worker, engine, LOCAL_CALL_TIMEOUT_S):
        calls.update_from_tensors(worker, engine, tensors, LOCAL_CALL_TIMEOUT_S)
    return True


def weight_receiver(worker: WorkerContext) -> DistributedReceiver:
    """Separate devices: SGLang's scheduler joins the broadcast group itself."""
    return DistributedReceiver(worker, _engine(worker))


# ---------------------------------------------------------------------------------------------
# memory lifecycle and shutdown
# ---------------------------------------------------------------------------------------------


def _sglang_tags(tags: list[str]) -> list[str] | None:
    """posttrain's tags that SGLang knows; None (everything) when both are asked for."""
    known = [t for t in tags if t in ("weights", "kv_cache")]
    return None if set(known) == {"weights", "kv_cache"} else known


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    engine = _engine(worker)
    if engine is None:
        return True
    if not engine_args_mod.memory_saver(worker):
        _warn_no_release(worker)
        return True
    wanted = _sglang_tags(tags)
    if wanted is None or wanted:  # nothing SGLang holds was asked for: nothing to do
        engine.release_memory_occupation(tags=wanted)
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    engine = _engine(worker)
    if engine is None or not engine_args_mod.memory_saver(worker):
        return True
    wanted = _sglang_tags(tags)
    if wanted is None or wanted:
        engine.resume_memory_occupation(tags=wanted)
        calls.flush_cache(worker, engine)
    return True


def _warn_no_release(worker: WorkerContext) -> None:
    kept = rank_state(worker)
    if kept.no_release_warned:
        return
    kept.no_release_warned = True
    if engine_args_mod.is_cuda(worker):
        reason = "enable_memory_saver is off"
    else:
        reason = "SGLang does not release memory on CPU"
    log.warning("%s: release/resume memory keeps the engine as it is", reason)


def shutdown_worker(worker: WorkerContext) -> bool:
    kept = rank_state(worker)
    engine, kept.engine = kept.engine, None
    if engine is not None:
        try:
            engine.shutdown()
        except Exception as exc:
            # E.g. a child not reaped within SGLang's 60 s: it was SIGKILLed and the rank exits
            # next; say so and still remove what can be removed.
            log.warning("SGLang engine shutdown: %s", exc)
        leftovers.remove_files(leftovers.ipc_paths(engine))
        del engine
        worker.model = None
        gc.collect()
    before, kept.shm_before = kept.shm_before, None
    if before is not None:
        leftovers.remove_shm_leftovers(before)
    return True
