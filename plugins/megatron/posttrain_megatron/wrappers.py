"""What megatron wraps: model chunks under DDP / Float16Module, torch optimizers under a (chained)
megatron optimizer. Shared by model building, training and checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def inner_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a (chained) megatron optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    parts = chained if chained is not None else [optimizer]
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]
