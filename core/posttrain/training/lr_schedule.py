"""The learning-rate schedule every training strategy follows (``training_args``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from posttrain.config.sections import RoleConfig, TrainingArgs, Workflow

log = logging.getLogger(__name__)


def run_optimizer_steps(workflow: Workflow) -> int:
    """The optimizer steps a trained role makes in the run: each of ``trainer.max_steps``
    updates it ``algorithm.ppo_epochs`` x ``num_mini_batches`` times."""
    algo = workflow.algorithm
    return workflow.trainer.max_steps * algo.ppo_epochs * algo.num_mini_batches


def with_schedule(role: RoleConfig, workflow: Workflow) -> RoleConfig:
    """``role`` with an unset ``training_args.max_steps`` (-1) set to the run's optimizer steps,
    as its ranks get it: the schedule then follows ``--set trainer.max_steps``. Resolved when
    the ranks start, not in the workflow, so the run's record keeps it unset and a resume that
    raises ``trainer.max_steps`` stretches the schedule rather than being refused as another
    run."""
    args = role.training_args
    if args is None or args.max_steps != -1:
        return role
    resolved = attrs.evolve(args, max_steps=run_optimizer_steps(workflow))
    return attrs.evolve(role, training_args=resolved)


def lr_lambda(args: TrainingArgs) -> Callable[[int], float]:
    """HF-style schedule multiplier: linear warmup from 0, then constant / linear / cosine decay
    to 0 at ``max_steps`` (constant when ``max_steps`` is unknown)."""
    total = args.max_steps if args.max_steps and args.max_steps > 0 else 0
    warmup = args.warmup_steps or (math.ceil(args.warmup_ratio * total) if total else 0)
    kind = args.lr_scheduler_type
    if kind != "constant" and not total:
        log.warning("lr_scheduler_type=%s needs training_args.max_steps > 0; decay disabled", kind)

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant" or not total:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
