"""Engine side of ``megatron_train`` / ``megatron_infer``: the functions the worker hooks call.

``worker.model`` is the list of model chunks (one per virtual pipeline stage);
``worker.engine_state(MegatronState)`` holds the mbridge bridge, the optimizer and the step
counters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from posttrain.backend import (
    end_process_group,
    is_cuda,
    log_once,
    lr_lambda,
    move_optimizer_state,
    rank_device,
    settle_cuda,
)
from posttrain_megatron.checkpointing import (
    begin_checkpoint,
    finish_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from posttrain_megatron.model_builder import (
    TRAIN,
    build_models,
    build_optimizer,
    setup_parallel,
)
from posttrain_megatron.state import MegatronState
from posttrain_megatron.training import compute_logprobs, compute_values, train_step
from posttrain_megatron.weights import export_hf, export_weights
from posttrain_megatron.wrappers import inner_optimizers

if TYPE_CHECKING:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    from posttrain import WorkerContext

__all__ = [
    "begin_checkpoint",
    "compute_logprobs",
    "compute_values",
    "export_hf",
    "export_weights",
    "finish_checkpoint",
    "load_checkpoint",
    "load_model",
    "release_memory",
    "resume_memory",
    "save_checkpoint",
    "setup_parallel",
    "shutdown_worker",
    "train_step",
]

log = logging.getLogger(__name__)


def load_model(worker: WorkerContext) -> list[torch.nn.Module]:
    models, bridge = build_models(worker)
    state = worker.engine_state(MegatronState)
    state.bridge = bridge
    state.vocab_size = bridge.vocab_size
    state.step = 0
    state.updates = 0
    if worker.strategy_name == TRAIN:
        state.optimizer = build_optimizer(worker, models)
        state.lr_multiplier = lr_lambda(worker.require_training_args())
    return models


# --------------------------------------------------------------------------------------------
# Memory lifecycle (colocated roles on GPU)
# --------------------------------------------------------------------------------------------


def _tags(worker: WorkerContext, tags: list[str] | None) -> set[str]:
    """What a release moves to the host: what was asked (everything by default) and the
    strategy config offloads (``param_offload``, ``grad_offload``, ``optimizer_offload``, as in
    verl); with none of them set a colocated role keeps its memory on the device."""
    cfg = worker.config
    # ``auto`` is resolved by the memory plan before the run; left unresolved, it means off.
    offloaded = {"weights"} if cfg.param_offload is True else set()
    if getattr(cfg, "grad_offload", False) is True:
        offloaded.add("grads")
    if getattr(cfg, "optimizer_offload", False) is True:
        offloaded.add("optimizer")
    return set(tags or ("weights", "grads", "optimizer")) & offloaded


def _buffers(model: torch.nn.Module) -> list[_ParamAndGradBuffer]:
    return list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", []))


def _move_optimizer_state(worker: WorkerContext, target: str | torch.device) -> None:
    optimizer = worker.engine_state(MegatronState).optimizer
    if optimizer is not None:
        # The step counters stay where the optimizer reads them.
        move_optimizer_state(inner_optimizers(optimizer), target, skip=("step",))


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if not is_cuda(worker):
        log_once(log, "megatron: release_memory on a CPU device: nothing to free", logging.INFO)
        return True
    wanted = _tags(worker, tags)
    if not wanted:
        return True  # nothing offloaded: no sync, no emptied cache
    params, grads = "weights" in wanted, bool(wanted & {"weights", "grads"})
    for model in worker.model:
        buffers = _buffers(model)
        if buffers:  # DDP: parameters and grads live in contiguous buffers
            for buffer in buffers:
                buffer.offload_to_cpu(move_params=params, move_grads=grads)
        elif params:
            model.cpu()
    if "optimizer" in wanted:
        _move_optimizer_state(worker, "cpu")
    settle_cuda(empty_cache=True)
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if not is_cuda(worker):
        return True
    wanted = _tags(worker, tags)
    if not wanted:
        return True
    params, grads = "weights" in wanted, bool(wanted & {"weights", "grads"})
    for model in worker.model:
        buffers = _buffers(model)
        if buffers:
            for buffer in buffers:
                buffer.reload_from_cpu(move_params=params, move_grads=grads)
        elif params:
            model.cuda(torch.cuda.current_device())
    if "optimizer" in wanted:
        _move_optimizer_state(worker, rank_device(worker))
    settle_cuda()
    return True


def shutdown_worker(worker: WorkerContext) -> bool:
    from megatron.core import parallel_state as ps

    worker.state.clear()  # this role's MegatronState, and the engine objects it holds, go
    worker.model = None
    end_process_group(teardown=ps.destroy_model_parallel)
    return True
