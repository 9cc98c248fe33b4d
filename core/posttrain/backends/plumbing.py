"""Torch plumbing every backend needs: the rank's device, rank 0, logging once, the export dtype,
an HF forward pass, memory release for colocated roles, the files beside exported weights and the
end of the process group. Public API (re-exported by ``posttrain``): backends use these instead
of their own copies.

Importing this module is cheap; each function imports torch when called.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from posttrain.backends.distributed import destroy_default_process_group
from posttrain.backends.models import load_tokenizer, torch_dtype

if TYPE_CHECKING:
    import torch

    from posttrain.config.sections import TrainingArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import SequenceBatch

# The memory a colocated role may release (``posttrain_release_memory``'s tags).
MEMORY_TAGS = ("weights", "kv_cache", "optimizer", "grads")

_logged_once: set[tuple[str, str]] = set()


def is_cuda(worker: WorkerContext) -> bool:
    """Whether the rank runs on a GPU (``worker.device`` is ``cuda`` or ``cuda:N``)."""
    return str(worker.device).startswith("cuda")


def rank_device(worker: WorkerContext) -> torch.device:
    """The rank's torch device: its current GPU, or the CPU."""
    import torch

    if is_cuda(worker):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_rank0() -> bool:
    """Rank 0 of the default process group (True without one)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def log_once(logger: logging.Logger, message: str, level: int = logging.DEBUG) -> None:
    """Log ``message`` the first time only (per logger), e.g. a no-op a loop would repeat."""
    key = (logger.name, message)
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)


def export_dtype(worker: WorkerContext) -> torch.dtype:
    """The dtype weights leave the trainer in (sync, export): the role's ``model_args.dtype``."""
    return torch_dtype(worker.model_args.dtype)


def forward_logits(model: Any, micro_batch: SequenceBatch) -> torch.Tensor:
    """An HF causal LM's logits of a micro-batch (no KV cache); a vision-language model's
    with the micro-batch's images (:func:`model_inputs`)."""
    out = model(
        **model_inputs(model, micro_batch),
        attention_mask=micro_batch.attention_mask,
        use_cache=False,
    )
    return out.logits


def model_inputs(model: Any, micro_batch: SequenceBatch) -> dict[str, torch.Tensor]:
    """``input_ids``, and for a vision-language model's batch with images their inputs
    (:func:`posttrain.protocol.image_forward_inputs`). ``model`` may be a wrapper (a DeepSpeed
    engine) whose ``module`` has the config."""
    from posttrain.protocol import image_forward_inputs

    if "pixel_values" not in micro_batch.tensors:
        return {"input_ids": micro_batch.input_ids}
    # A DeepSpeed engine's own ``config`` is DeepSpeed's dict: the HF model's is its module's.
    config = getattr(model, "module", model).config
    return image_forward_inputs(
        micro_batch.input_ids, micro_batch["pixel_values"], micro_batch["image_grid_thw"], config
    )


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute an HF model's activations in backward (non-reentrant checkpointing)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def drain(buckets: Iterable[Any]) -> bool:
    """Consume ``buckets`` without importing them (an engine with nothing to load): a transport
    may hand a generator whose export runs collectives every rank must join. True."""
    for _ in buckets:
        pass
    return True


def adamw(parameters: Iterable[Any], args: TrainingArgs) -> torch.optim.Optimizer:
    """AdamW with the role's ``training_args`` (learning rate, betas, epsilon, weight decay).
    Parameters all on a GPU take the fused implementation (one kernel over many tensors, as
    transformers' Trainer defaults to): a 1.5B model's optimizer step on an H200 took 31.5 ms
    with the multi-tensor one, 25.8 ms with it."""
    import torch

    params = list(parameters)
    on_gpu = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        fused=True if on_gpu else None,  # None: torch's default for the device
    )


def rng_state(worker: WorkerContext) -> dict[str, Any]:
    """The rank's random-number state (CPU, and its GPU's), for a checkpoint."""
    import torch

    return {
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if is_cuda(worker) else None,
    }


def restore_rng_state(worker: WorkerContext, state: dict[str, Any]) -> None:
    """Set what :func:`rng_state` saved (the GPU's only on a GPU rank)."""
    import torch

    torch.set_rng_state(state["rng_cpu"])
    if state.get("rng_cuda") is not None and is_cuda(worker):
        torch.cuda.set_rng_state(state["rng_cuda"])


def tensor_parallel_replicas(worker: WorkerContext, tp: int, knob: str) -> dict[str, int]:
    """A rollout role's ranks as replicas of ``tp`` ranks each (ranks ``[k*tp, (k+1)*tp)`` form
    replica ``k``, whose first rank drives an engine over them): the parallel coordinates
    ``posttrain_setup_parallel`` returns. ``knob``: the config key that set ``tp``, named in
    errors."""
    from posttrain.errors import UserError

    if worker.world_size % tp:
        raise UserError(
            f"{worker.strategy_name}: {worker.world_size} ranks cannot be split into replicas of "
            f"{knob}={tp}"
        )
    if tp > 1 and not is_cuda(worker):
        raise UserError(f"{worker.strategy_name}: {knob} > 1 needs GPUs (device is cpu)")
    return {
        "dp_rank": worker.rank // tp,
        "dp_size": worker.world_size // tp,
        "tp_rank": worker.rank % tp,
        "tp_size": tp,
    }


def leads_replica(worker: WorkerContext) -> bool:
    """Whether the rank drives its replica's engine (see :func:`tensor_parallel_replicas`)."""
    return worker.parallel.get("tp_rank", 0) == 0


def memory_tags(tags: Iterable[str] | None) -> set[str]:
    """The tags of a release/resume call; none means the weights."""
    return set(tags or ("weights",))


def move_optimizer_state(
    optimizers: Iterable[Any], device: torch.device | str, skip: tuple[str, ...] = ()
) -> None:
    """Move every tensor of the optimizers' state (but the keys in ``skip``) to ``device``."""
    import torch

    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key not in skip:
                    state[key] = value.to(device, non_blocking=True)


def settle_cuda(empty_cache: bool = False) -> None:
    """Wait for the GPU's queued work (a release must be complete before another role runs);
    with ``empty_cache``, give freed blocks back to the driver."""
    import torch

    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()


# transformers' file of an image processor's settings.
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"


def save_tokenizer_beside(worker: WorkerContext, path: str, logger: logging.Logger) -> None:
    """Write the role's tokenizer into an exported model directory; a tokenizer that cannot be
    saved is logged, since the weights are usable with the original one."""
    try:
        tokenizer = load_tokenizer(worker.model_args, worker.base_dir)
        tokenizer.save_pretrained(path)
    except (OSError, ValueError) as exc:
        logger.warning("export_hf could not save the tokenizer: %s", exc)
        return
    # A vision-language model's image processor goes with it: the export processes images as
    # the run did.
    source = os.path.join(str(tokenizer.name_or_path), IMAGE_PROCESSOR_FILE)
    if os.path.exists(source):
        shutil.copyfile(source, os.path.join(path, IMAGE_PROCESSOR_FILE))


def end_process_group(teardown: Callable[[], None] | None = None) -> None:
    """A rank's last collective step: wait for every peer (a rank tearing down gloo while a peer
    still finishes a collective aborts the peer), run ``teardown`` (an engine's own groups),
    then destroy the default group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    if teardown is not None:
        teardown()
    destroy_default_process_group()
