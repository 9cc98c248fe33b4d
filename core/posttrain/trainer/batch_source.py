"""Where the loop's batches come from: made when a step asks (``max_staleness: 0``) or by a
producer thread that runs ahead of training (see :mod:`posttrain.rollout.batches`), and which
rank processes the loop's thread may ask for their figures in each case."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from posttrain.config.sections import Workflow
from posttrain.launch.base import WorkerGroup
from posttrain.rollout.batches import AsyncBatches, ProducedBatch, SynchronousBatches
from posttrain.rollout.generation import Rollout
from posttrain.rollout.groups import collect_groups
from posttrain.tasks.data import PromptSampler
from posttrain.trainer.call_stats import phase_call_stats, split_by_caller
from posttrain.trainer.phase_timer import PhaseTimer

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.rollout.groups import ScoredGroups
    from posttrain.rollout.partial import EngineTurn


def batch_source(
    wf: Workflow,
    rollout: Rollout,
    sampler: PromptSampler,
    groups: dict[str, WorkerGroup],
    step: int,
    console: Console,
    ahead: Sequence[ProducedBatch] = (),
) -> tuple[SynchronousBatches | AsyncBatches, dict[str, WorkerGroup]]:
    """The batches of the steps after ``step`` (the policy the rollout engine holds now), and
    the groups the loop's thread asks for rank figures. ``ahead``: the batches of the steps
    after ``step`` a checkpoint kept, trained on first."""
    algo = wf.algorithm

    def produce(
        index: int, timer: PhaseTimer, engine_turn: EngineTurn | None = None
    ) -> tuple[ScoredGroups, dict[str, float], dict[str, int]]:
        scored, sampling = collect_groups(
            lambda round_: rollout(index, round_, timer, engine_turn),
            algo.rollout_batch_size,
            algo.group_size,
            algo.dynamic_sampling,
            algo.max_sampling_rounds,
        )
        return scored, sampling, sampler.state()

    if not algo.max_staleness:
        return SynchronousBatches(produce, step, ahead), groups
    # The producer's thread alone calls the rollout (and reward) processes: it also asks
    # them for their figures, the loop's thread asks the others.
    stats_groups, producers = split_by_caller(groups)
    batches = AsyncBatches(
        produce,
        step,
        algo.max_staleness,
        first=step + 1,
        last=wf.trainer.max_steps,
        make_timer=lambda: PhaseTimer(console, 0, 0, show=False),
        rank_stats=lambda: phase_call_stats(producers),
        partial=algo.partial_rollout,
        ahead=ahead,
    )
    return batches, stats_groups
