"""Where a phase's time and memory go on the ranks: each rank process records, per hook, the
seconds spent in it and the peak GPU memory (:meth:`~posttrain.launch.worker.WorkerRuntime.
call_stats`); once a step the driver asks one role of each set of rank processes and logs
``rank_time/<phase>_s`` (the slowest rank's seconds in the phase's hooks: the phase's time minus
it is the driver's and the transfers' share), ``memory/rank_rss_gib`` (the largest rank process's
resident memory) and, on GPUs, ``memory/<phase>_peak_gib``.

With asynchronous rollout the producer's thread asks the processes it drives itself, between two
generations: asked from the loop's thread, they would answer only after the generation under way.
"""

from __future__ import annotations

from posttrain.config.sections import PRODUCER_ROLES
from posttrain.launch.base import WorkerGroup
from posttrain.launch.worker import PROCESS_STATS

# The phase whose work a hook is.
PHASE_OF_HOOK = {
    "generate": "rollout",
    "compute_scores": "reward",
    "compute_logprobs": "logprobs",
    "compute_values": "values",
    "train_step": "train",
    "import_weights": "weight_sync",
}


def split_by_caller(
    groups: dict[str, WorkerGroup],
) -> tuple[dict[str, WorkerGroup], dict[str, WorkerGroup]]:
    """The groups the loop's thread asks, and those the producer's thread asks: the rollout and
    reward roles, unless their processes also host a role the loop calls."""
    loop_roles = [role for role in groups if role not in PRODUCER_ROLES]
    producers = {
        role: group
        for role, group in groups.items()
        if role in PRODUCER_ROLES
        and not any(group.shares_processes_with(groups[other]) for other in loop_roles)
    }
    return {r: g for r, g in groups.items() if r not in producers}, producers


def add_call_stats(metrics: dict[str, float], stats: dict[str, float]) -> None:
    """Add ``stats`` into ``metrics``: seconds add up, peaks take the larger."""
    for key, value in stats.items():
        if key.startswith("memory/"):
            metrics[key] = max(metrics.get(key, 0.0), value)
        else:
            metrics[key] = metrics.get(key, 0.0) + value


def phase_call_stats(groups: dict[str, WorkerGroup]) -> dict[str, float]:
    """``rank_time/<phase>_s`` and ``memory/<phase>_peak_gib`` of the step's phases, and
    ``memory/rank_rss_gib``."""
    asked: list[WorkerGroup] = []
    out: dict[str, float] = {}
    for group in groups.values():
        if any(group.shares_processes_with(other) for other in asked):
            continue  # the same processes: their figures came with the other role's
        asked.append(group)
        seconds: dict[str, list[float]] = {}
        for answer in group.call("call_stats"):
            process = answer.pop(PROCESS_STATS, None)
            if process is not None:
                key, rss = "memory/rank_rss_gib", process["rss_bytes"] / 2**30
                out[key] = max(out.get(key, 0.0), rss)
            for hook, stats in answer.items():
                phase = PHASE_OF_HOOK.get(hook)
                if phase is None:
                    continue
                seconds.setdefault(phase, []).append(stats["seconds"])
                if "peak_bytes" in stats:
                    key = f"memory/{phase}_peak_gib"
                    out[key] = max(out.get(key, 0.0), stats["peak_bytes"] / 2**30)
        for phase, per_rank in seconds.items():
            key = f"rank_time/{phase}_s"
            out[key] = out.get(key, 0.0) + max(per_rank)
    return out
