"""Test support: the engine of four DELIBERATELY BROKEN trainers (broken_trainers.py): the
example's correct ``ddp_train`` engine with the bug the strategy's name says."""

from __future__ import annotations

from posttrain_example_plugin import ddp_engine as correct
from posttrain_example_plugin.ddp_engine import (
    DDPState,
    compute_logprobs,
    export_hf,
    load_model,
    release_memory,
    resume_memory,
    save_checkpoint,
    setup_parallel,
    shutdown_worker,
)

__all__ = [
    "compute_logprobs",
    "export_hf",
    "export_weights",
    "load_checkpoint",
    "load_model",
    "release_memory",
    "resume_memory",
    "save_checkpoint",
    "setup_parallel",
    "shutdown_worker",
    "train_step",
]


def train_step(worker, batch, loss_fn):
    if worker.strategy_name != "broken_no_allreduce":
        return correct.train_step(worker, batch, loss_fn)
    # DDP's no_sync: the backward passes skip the all-reduce, each rank steps on its own share.
    with worker.engine_state(DDPState).model.no_sync():
        return correct.train_step(worker, batch, loss_fn)


def load_checkpoint(worker, path):
    state = worker.engine_state(DDPState)
    fresh_scheduler = state.scheduler.state_dict()
    loaded = correct.load_checkpoint(worker, path)
    if worker.strategy_name == "broken_scheduler_not_restored":
        state.scheduler.load_state_dict(fresh_scheduler)
    elif worker.strategy_name == "broken_optimizer_not_restored":
        state.optimizer.state.clear()
    return loaded


def export_weights(worker, bucket_bytes, on_device=False):
    if worker.strategy_name == "broken_rank0_only_export" and worker.rank != 0:
        return iter(())
    return correct.export_weights(worker, bucket_bytes, on_device)
