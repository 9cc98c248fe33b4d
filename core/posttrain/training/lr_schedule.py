"""The learning-rate schedule every training strategy follows (``training_args``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

log = logging.getLogger(__name__)


def lr_lambda(args) -> Callable[[int], float]:
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
