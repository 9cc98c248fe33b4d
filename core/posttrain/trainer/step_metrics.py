"""What the loop adds to a step's metrics besides the phases' own: timings, the driver's
calls, throughput, the ranks' figures and, with asynchronous rollout, the batch's staleness."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from posttrain.launch.worker import resident_bytes
from posttrain.rollout.batches import ProducedBatch
from posttrain.trainer.call_stats import add_call_stats, phase_call_stats
from posttrain.trainer.phase_timer import PHASES, PhaseTimer

if TYPE_CHECKING:
    from posttrain.launch.base import WorkerGroup


def staleness(step: int, produced: ProducedBatch, max_staleness: int) -> dict[str, float]:
    """How many updates behind the trainer the policy that sampled the batch is."""
    if not max_staleness:
        return {}
    return {
        "async/staleness": float(step - 1 - produced.policy_version),
        "async/policy_version": float(produced.policy_version),
    }


def add_timings(
    metrics: dict[str, float],
    timer: PhaseTimer,
    start: float,
    driver_calls: float,
    tokens: float,
    stats_groups: dict[str, WorkerGroup],
) -> None:
    """The step's timings so far: each phase, the whole step, and the driver's own work (what
    the phases do not account for, and its calls, ``driver_calls``)."""
    metrics.update(timer.pop())
    metrics["time/step"] = time.perf_counter() - start
    phases = sum(v for k, v in metrics.items() if k.removeprefix("time/") in PHASES)
    metrics["time/outside_phases"] = metrics["time/step"] - phases
    metrics["driver/calls"] = driver_calls
    metrics["perf/tokens_per_s"] = tokens / metrics["time/step"]
    metrics["memory/driver_rss_gib"] = resident_bytes() / 2**30
    add_call_stats(metrics, phase_call_stats(stats_groups))
