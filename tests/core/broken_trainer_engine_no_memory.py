"""Test support: the engine of a DELIBERATELY BROKEN trainer (broken_trainers.py): the example's
``ddp_train`` without release_memory, resume_memory and shutdown_worker."""

from __future__ import annotations

from posttrain_example_plugin.ddp_engine import (
    compute_logprobs,
    export_hf,
    export_weights,
    load_checkpoint,
    load_model,
    save_checkpoint,
    setup_parallel,
    train_step,
)

__all__ = [
    "compute_logprobs",
    "export_hf",
    "export_weights",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
    "setup_parallel",
    "train_step",
]
