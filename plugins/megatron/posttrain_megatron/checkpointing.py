"""Megatron dist checkpoints of model + optimizer, loadable under another TP / PP / DP layout.

Model tensors are saved as sharded tensors with global names (megatron's ``sharded_state_dict``),
the distributed optimizer in the ``fully_reshardable`` format. Per-rank extras (step counters,
RNG states) go to ``extra_state_rank<r>.pt``.

The Adam step count is restored from the extras rather than trusted from the optimizer state:
without apex / TransformerEngine, megatron-core can load one ``step`` tensor shared by every
parameter, which then advances once per parameter per update (weights drift silently), and a
``fully_reshardable`` load may not carry ``step`` at all. Each parameter gets its own count.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from posttrain_megatron.model_builder import inner_optimizers, is_cuda, unwrap

_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_keys(models) -> list[str]:
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _sharded_state(models, optimizer, is_loading: bool) -> dict:
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


def save_checkpoint(worker, path: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    target = os.path.join(path, "megatron")
    if _rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    # A never-stepped optimizer has no state to shard (megatron asserts on it): model only.
    optimizer = worker.state.get("optimizer") if worker.state.get("updates") else None
    dist_checkpointing.save(_sharded_state(worker.model, optimizer, False), target)
    layout = {**current_layout(), "has_optimizer": optimizer is not None}
    torch.save(
        {
            "step": worker.state.get("step", 0),
            "updates": worker.state.get("updates", 0),
            "layout": layout,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if is_cuda(worker) else None,
            "rng_tracker": get_cuda_rng_tracker().get_states(),
        },
        _extra_path(path, _rank()),
    )
    if _rank() == 0:
        with open(os.path.join(path, "megatron_layout.json"), "w") as f:
            json.dump({**layout, "strategy": worker.strategy_name}, f)
    dist.barrier()
    return layout


def load_checkpoint(worker, path: str) -> bool:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    own = _extra_path(path, _rank())
    extra = torch.load(own if os.path.exists(own) else _extra_path(path, 0), weights_only=False)
    optimizer = worker.state.get("optimizer")
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
    worker.state["step"] = extra["step"]
    worker.state["updates"] = extra["updates"]
    saved_layout = {k: v for k, v in extra["layout"].items() if k != "has_optimizer"}
    if saved_layout == current_layout() and os.path.exists(own):  # same layout: same RNG
        torch.set_rng_state(extra["rng_cpu"])
        if extra["rng_cuda"] is not None and is_cuda(worker):
            torch.cuda.set_rng_state(extra["rng_cuda"])
        get_cuda_rng_tracker().set_states(extra["rng_tracker"])
    dist.barrier()
    return True


def current_layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "format": "megatron_dist",
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def set_adam_steps(optimizer, updates: int) -> None:
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


def load_model_weights(models, path: str) -> None:
    """Initial weights from a Megatron dist checkpoint (``posttrain convert`` writes one)."""
    from megatron.core import dist_checkpointing

    target = (
        os.path.join(path, "megatron") if os.path.isdir(os.path.join(path, "megatron")) else path
    )
    loaded = dist_checkpointing.load(_sharded_state(models, None, True), target)
    for key, model in zip(_model_keys(models), models):
        unwrap(model).load_state_dict(loaded[key])


def save_model_weights(models, path: str) -> None:
    """A model-only dist checkpoint (what ``use_dist_checkpointing`` loads)."""
    from megatron.core import dist_checkpointing

    target = os.path.join(path, "megatron")
    if _rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(models, None, False), target)
    dist.barrier()
