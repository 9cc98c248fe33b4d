"""The trainer/rollout GPU split chosen from a run's measured phase times (``posttrain plan
WORKFLOW --from-run RUN_DIR``).

A run of the workflow (synchronous or asynchronous, finished or not) gives, per step, each
phase's seconds (``RUN_DIR/metrics.jsonl``, else the run's ``history.jsonl``) and, in its record
(``RUN_DIR/workflow.yaml``), the GPUs each role ran on. The first step is left out (compiles,
warm-up); every figure below is the median over the steps after it:

* ``r``: the rollout's seconds (``time/rollout``; asynchronous: the producer's
  ``async/rollout_s``), on the run's ``R0`` rollout GPUs (``actor_infer.device_mapping``);
  ``r90`` its 90th percentile over the steps (long-tailed lengths make it larger than ``r``);
* ``w``: the reward's seconds (``time/reward`` / ``async/reward_s``), the driver's or the reward
  model's, taken as they are;
* ``l``: the trainer side's seconds: ``time/logprobs`` + ``time/values`` + ``time/train``
  (the policy's and the reference's log-probs, the critic, the update), on the run's ``T0``
  trainer GPUs (``actor_train.device_mapping``);
* ``o``: the driver's own seconds between phases (``time/outside_phases``), taken as they are;
* ``s``: the weight sync's seconds. Measured (``time/weight_sync``; asynchronous: the ranks'
  ``rank_time/weight_sync_s``, since the phase's time there includes waiting for the engine
  between two generations) where the run synced the way the candidate will: across GPUs for a
  disaggregated split after a disaggregated run, in process for a colocated one after a
  colocated run. Otherwise the bytes a sync moved (``weight_sync/mb``) over
  :data:`BROADCAST_GB_S`.

The model: work on the GPUs is data-parallel, so each side's time goes as one over its GPUs,
the rollout's with its replicas and the trainer's with its data-parallel ranks. For ``T``
trainer GPUs and ``R`` rollout GPUs::

    trainer side  P_T = l * T0 / T + o
    rollout side  P_R = r * R0 / R + w
    asynchronous (max_staleness k >= 1):  step = max(P_T, P_R) + s
    on-policy (max_staleness 0):          step = P_T + P_R + s
    colocated on all N GPUs (on-policy):  step = l * T0 / N + o + r * R0 / N + w + s

Asynchronously the faster side waits for the slower one; the weight sync holds both (the
rollout engine is taken between two generations). Each side's idle share is the part of the
step it waits: ``(step - P_side - s) / step``. Steps per hour are ``3600 / step``. The 1/GPUs
scaling is the optimistic end: a decode's step costs about the same for fewer rows once the
weights' reads dominate, and small per-rank batches train below the measured FLOP/s. The
colocated row is the run itself where the run was colocated on as many GPUs (the split's gain is
then over what was measured); otherwise it is the model's most optimistic row (every phase over
all GPUs, no time to switch roles on a GPU) and never the recommendation.

The staleness for a split: the asynchronous producer rolls out up to ``k`` batches ahead of the
trainer while its typical batch is quicker than the trainer's step, and ``k`` batches banked let
the trainer go on through one slow batch of up to ``k`` trainer steps. So::

    k = clamp(ceil(P_R90 / P_T), 1, 4)   where the typical rollout is not the long pole (P_R <= P_T)
    k = 1                                 where it is (P_R > P_T): nothing is ever banked, more
                                          staleness buys nothing; more rollout GPUs do

with ``P_R90 = r90 * R0 / R + w``. Sides within ~2x of each other without a tail get 1; a
rollout whose slow (p90) batches outlast several trainer steps gets more.

A split is offered only where the workflow with its device mappings passes validation (the
strategies' parallel sizes, the batch's split over the ranks) and where its memory plan
(:mod:`posttrain.memory.plan`) fits the card: ``--gpu-memory-gib``, else this machine's GPU.
The best split is the fitting one with the shortest predicted asynchronous step.

Nothing here imports torch or an engine: it runs on the driver, before any process starts.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.report import ErrorReport
from posttrain.config.sections import Workflow
from posttrain.errors import UserError
from posttrain.memory.estimate import GIB
from posttrain.memory.plan import card_bytes, gib, plan_memory, refusal, resolve_memory
from posttrain.paths import display_path

if TYPE_CHECKING:
    from collections.abc import Iterable

    from rich.console import Console

    from posttrain.host.plugin_host import PluginHost

# GB/s of a weight sync across GPUs, for a layout the run did not measure: the ``broadcast``
# transport measured 106-122 GB/s between two H100s (docs/performance.md, weight sync between
# cards).
BROADCAST_GB_S = 100.0
# The most batches the producer may run ahead of the trainer that a recommendation asks for.
MAX_STALENESS = 4
# The roles on the trainer's GPUs and on the rollout's in a disaggregated split.
TRAINER_ROLES = ("actor_train", "reference", "critic")
ROLLOUT_ROLES = ("actor_infer", "reward")
# Keys a split changes: differences there between the workflow and the run's record are expected.
_LAYOUT_KEYS = (".device_mapping", ".world_size", "algorithm.max_staleness")


@attrs.frozen(kw_only=True)
class PhaseTimes:
    """A run's steady phase seconds (medians over the steps after the first; see the module)."""

    rollout: float  # r, on the run's rollout GPUs
    rollout_p90: float  # r90
    reward: float  # w
    trainer: float  # l: logprobs + values + train, on the run's trainer GPUs
    driver: float  # o
    sync: float  # s as measured
    sync_bytes: float  # bytes a sync moved (0 where not logged)
    step: float  # the measured step, checkpoints and evaluations left out
    steps: int  # the steps the medians are over
    first_left_out: bool  # False where only the first step was logged (its compile counts)
    asynchronous: bool  # the run rolled out asynchronously


@attrs.frozen(kw_only=True)
class RunLayout:
    """The GPUs a run's roles used, from its record."""

    trainer_gpus: int  # T0
    rollout_gpus: int  # R0
    gpus: int  # every device some role used
    colocated: bool  # the rollout shared the trainer's GPUs
    max_staleness: int


@attrs.frozen(kw_only=True)
class Prediction:
    """One candidate layout's predicted step (seconds; shares in [0, 1])."""

    trainer_gpus: int
    rollout_gpus: int
    colocated: bool
    staleness: int  # the recommended algorithm.max_staleness (0: on-policy)
    trainer_side: float  # P_T
    rollout_side: float  # P_R
    sync: float  # s
    step: float  # at ``staleness``
    on_policy_step: float  # the same layout with max_staleness 0
    trainer_idle: float | None  # None where colocated (the GPUs switch roles)
    rollout_idle: float | None

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step if self.step > 0 else math.inf

    @property
    def label(self) -> str:
        if self.colocated:
            return f"{self.trainer_gpus} colocated"
        return f"{self.trainer_gpus} + {self.rollout_gpus}"


@attrs.frozen(kw_only=True)
class Fit:
    """Whether a candidate's workflow validates and its memory plan fits the card."""

    valid: bool
    fits: bool | None  # None where the card is unknown
    peak: int | None = None  # bytes, the plan's worst GPU and phase
    reason: str = ""  # the validation error or the refusal's first line


# -- reading a run ------------------------------------------------------------------------------


def read_steps(run_dir: str) -> tuple[list[dict[str, Any]], str]:
    """The run's step records with timings (``metrics.jsonl``, else ``history.jsonl``) and the
    file they came from. A line cut short (a killed run) ends the read."""
    for name in ("metrics.jsonl", "history.jsonl"):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            break
    else:
        raise UserError(
            f"{display_path(run_dir)} has no metrics.jsonl or history.jsonl: give the directory "
            "of a run (its trainer.output_dir) that logged at least one step"
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            if isinstance(record, dict) and record.get("step", 0) >= 1 and "time/step" in record:
                records.append(record)
    if not records:
        raise UserError(f"{display_path(path)} holds no step with timings yet")
    return records, path


def _median(records: list[dict[str, Any]], *keys: str) -> float:
    """The median over ``records`` of the sum of ``keys`` (absent keys count 0)."""
    return statistics.median(sum(float(r.get(k, 0.0)) for k in keys) for r in records)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def phase_times(records: list[dict[str, Any]]) -> PhaseTimes:
    """The steady phase times of ``records`` (a run's steps): medians over the steps after the
    first (all of them where only one was logged)."""
    first = min(r["step"] for r in records)
    steady = [r for r in records if r["step"] > first] or records
    asynchronous = any("async/rollout_s" in r for r in steady)
    rollout_key, reward_key = (
        ("async/rollout_s", "async/reward_s") if asynchronous else ("time/rollout", "time/reward")
    )
    if not any(rollout_key in r for r in steady):
        raise UserError(f"the run's steps log no {rollout_key}: no rollout time to split by")
    # Asynchronously, the ranks' seconds (the phase's include waiting for the engine), over the
    # steps that logged them (the producer's ranks report theirs between two generations).
    ranks = [r for r in steady if "rank_time/weight_sync_s" in r]
    if asynchronous and ranks:
        sync = _median(ranks, "rank_time/weight_sync_s")
    else:
        sync = _median(steady, "time/weight_sync")
    rollouts = [float(r.get(rollout_key, 0.0)) for r in steady]
    step = statistics.median(
        float(r["time/step"])
        - float(r.get("time/checkpoint", 0.0))
        - float(r.get("time/evaluate", 0.0))
        for r in steady
    )
    return PhaseTimes(
        rollout=statistics.median(rollouts),
        rollout_p90=_p90(rollouts),
        reward=_median(steady, reward_key),
        trainer=_median(steady, "time/logprobs", "time/values", "time/train"),
        driver=max(0.0, _median(steady, "time/outside_phases")),
        sync=sync,
        sync_bytes=_median(steady, "weight_sync/mb") * 2**20,
        step=step,
        steps=len(steady),
        first_left_out=len(steady) < len(records),
        asynchronous=asynchronous,
    )


def run_layout(recorded: dict[str, Any]) -> RunLayout:
    """The GPUs of each side in a run's recorded workflow (the record's ``workflow``)."""

    def devices(section: str) -> set[int]:
        block = recorded.get(section)
        if not isinstance(block, dict) or block.get("strategy_args") is None:
            return set()
        return {int(d) for d in block.get("device_mapping") or ()}

    trainer, rollout = devices("actor_train"), devices("actor_infer")
    if not trainer or not rollout:
        raise UserError("the run's record has no actor_train or actor_infer devices")
    every = set().union(*(devices(s) for s in (*TRAINER_ROLES, *ROLLOUT_ROLES)))
    algorithm = recorded.get("algorithm") or {}
    return RunLayout(
        trainer_gpus=len(trainer),
        rollout_gpus=len(rollout),
        gpus=len(every),
        colocated=bool(trainer & rollout),
        max_staleness=int(algorithm.get("max_staleness") or 0),
    )


def read_run(run_dir: str) -> tuple[PhaseTimes, RunLayout, dict[str, Any], str]:
    """A run's steady phase times, its layout, its recorded workflow and its steps' file."""
    from posttrain.checkpoint.record import RECORD, read_record

    record_path = os.path.join(run_dir, RECORD)
    if not os.path.isfile(record_path):
        raise UserError(
            f"{display_path(run_dir)} has no {RECORD}: give the directory of a run (its "
            "trainer.output_dir); a run records its workflow there when it starts"
        )
    recorded = read_record(record_path)["workflow"]
    records, path = read_steps(run_dir)
    return phase_times(records), run_layout(recorded), recorded, path


# -- the model ---------------------------------------------------------------------------------


def sync_seconds(times: PhaseTimes, layout: RunLayout, colocated: bool) -> float:
    """``s`` for a candidate: as measured where the run synced the same way, else its bytes
    over :data:`BROADCAST_GB_S` (the measured time where the bytes were not logged)."""
    if colocated == layout.colocated or times.sync_bytes <= 0:
        return times.sync
    return times.sync_bytes / (BROADCAST_GB_S * 1e9)


def staleness_for(trainer_side: float, rollout_side: float, rollout_p90_side: float) -> int:
    """The ``max_staleness`` that keeps both sides busy (the rule in the module's docstring)."""
    if rollout_side > trainer_side or trainer_side <= 0:
        return 1
    return max(1, min(MAX_STALENESS, math.ceil(rollout_p90_side / trainer_side - 1e-9)))


def predict(
    times: PhaseTimes, layout: RunLayout, trainer_gpus: int, rollout_gpus: int
) -> Prediction:
    """The disaggregated split ``trainer_gpus + rollout_gpus`` (asynchronous)."""
    trainer_side = times.trainer * layout.trainer_gpus / trainer_gpus + times.driver
    scale = layout.rollout_gpus / rollout_gpus
    rollout_side = times.rollout * scale + times.reward
    sync = sync_seconds(times, layout, colocated=False)
    step = max(trainer_side, rollout_side) + sync
    return Prediction(
        trainer_gpus=trainer_gpus,
        rollout_gpus=rollout_gpus,
        colocated=False,
        staleness=staleness_for(
            trainer_side, rollout_side, times.rollout_p90 * scale + times.reward
        ),
        trainer_side=trainer_side,
        rollout_side=rollout_side,
        sync=sync,
        step=step,
        on_policy_step=trainer_side + rollout_side + sync,
        trainer_idle=(step - trainer_side - sync) / step if step > 0 else 0.0,
        rollout_idle=(step - rollout_side - sync) / step if step > 0 else 0.0,
    )


def predict_colocated(times: PhaseTimes, layout: RunLayout, gpus: int) -> Prediction:
    """Every role on all ``gpus`` (hybrid, on-policy): the phases one after the other."""
    trainer_side = times.trainer * layout.trainer_gpus / gpus + times.driver
    rollout_side = times.rollout * layout.rollout_gpus / gpus + times.reward
    sync = sync_seconds(times, layout, colocated=True)
    step = trainer_side + rollout_side + sync
    return Prediction(
        trainer_gpus=gpus,
        rollout_gpus=gpus,
        colocated=True,
        staleness=0,
        trainer_side=trainer_side,
        rollout_side=rollout_side,
        sync=sync,
        step=step,
        on_policy_step=step,
        trainer_idle=None,
        rollout_idle=None,
    )


def candidates(times: PhaseTimes, layout: RunLayout, gpus: int) -> list[Prediction]:
    """Every split of ``gpus`` into trainer + rollout GPUs, then all of them colocated."""
    splits = [predict(times, layout, t, gpus - t) for t in range(1, gpus)]
    return [*splits, predict_colocated(times, layout, gpus)]


# -- the candidates' workflows -----------------------------------------------------------------


def candidate_workflow(workflow: Workflow, prediction: Prediction, staleness: int) -> Workflow:
    """``workflow`` laid out as ``prediction`` says, with ``algorithm.max_staleness``."""
    trainer = tuple(range(prediction.trainer_gpus))
    if prediction.colocated:
        rollout = trainer
    else:
        rollout = tuple(
            range(prediction.trainer_gpus, prediction.trainer_gpus + prediction.rollout_gpus)
        )
    changes: dict[str, Any] = {}
    for name in (*TRAINER_ROLES, "actor_infer"):
        role = getattr(workflow, name)
        if role is not None:
            devices = rollout if name == "actor_infer" else trainer
            changes[name] = attrs.evolve(role, device_mapping=devices, world_size=None)
    if workflow.reward.strategy_args is not None:
        changes["reward"] = attrs.evolve(workflow.reward, device_mapping=rollout, world_size=None)
    changes["algorithm"] = attrs.evolve(workflow.algorithm, max_staleness=staleness)
    return attrs.evolve(workflow, **changes)


def validation_errors(workflow: Workflow, host: PluginHost) -> list[str]:
    """What ``posttrain validate`` would refuse in ``workflow`` (rendered)."""
    report = ErrorReport()
    host.hook.posttrain_validate_workflow(
        workflow=workflow, strategies=host.strategies(), report=report, hook=host.hook
    )
    return [issue.render() for issue in report.errors]


def check_fit(workflow: Workflow, host: PluginHost, capacity: int | None) -> Fit:
    """Whether ``workflow`` (a candidate) validates and its memory plan fits ``capacity`` bytes
    a GPU, with ``auto`` checkpointing resolved as ``posttrain plan`` and ``run`` do."""
    errors = validation_errors(workflow, host)
    if errors:
        return Fit(valid=False, fits=False, reason=errors[0])
    resolved = resolve_memory(workflow, host, capacity)
    plan = plan_memory(resolved, host, capacity)
    worst = plan.worst()
    peak = worst.total if worst is not None else None
    if capacity is None:
        return Fit(valid=True, fits=None, peak=peak)
    why = refusal(plan)
    if why is not None:
        over = why.splitlines()[1].strip() if "\n" in why else why
        return Fit(valid=True, fits=False, peak=peak, reason=over)
    return Fit(valid=True, fits=True, peak=peak)


def best_split(rows: list[tuple[Prediction, Fit]]) -> Prediction | None:
    """The disaggregated split with the shortest predicted step among those that validate and
    fit (or whose fit is unknown: no card to check against); None when there is none."""
    usable = [p for p, fit in rows if not p.colocated and fit.valid and fit.fits is not False]
    return min(usable, key=lambda p: (p.step, -p.trainer_gpus), default=None)


def yaml_lines(workflow: Workflow) -> list[str]:
    """The settings of a candidate ``workflow`` to paste: each role's devices, the staleness."""

    def listed(devices: Iterable[int]) -> str:
        return "[" + ", ".join(str(d) for d in devices) + "]"

    lines = []
    for name in (*TRAINER_ROLES, "actor_infer"):
        role = getattr(workflow, name)
        if role is not None:
            lines.append(f"{name}.device_mapping: {listed(role.device_mapping)}")
    if workflow.reward.strategy_args is not None:
        lines.append(f"reward.device_mapping: {listed(workflow.reward.device_mapping)}")
    lines.append(f"algorithm.max_staleness: {workflow.algorithm.max_staleness}")
    return lines


def gpu_count() -> int | None:
    """This machine's GPUs, from ``nvidia-smi -L``; None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in out.splitlines()) or None


# -- the command ---------------------------------------------------------------------------------


def _differences(recorded: dict[str, Any], workflow: Workflow) -> list[str]:
    from posttrain.checkpoint.record import run_changes

    return [
        change
        for change in run_changes(recorded, workflow)
        if not any(key in change.split(":")[0] for key in _LAYOUT_KEYS)
    ]


def _secs(value: float) -> str:
    return f"{value:.3g}" if value >= 0.001 else "<0.001"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_split(
    workflow: Workflow,
    host: PluginHost,
    console: Console,
    run_dir: str,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
) -> bool:
    """``posttrain plan WORKFLOW --from-run RUN_DIR``: the candidate splits of ``gpus`` (default:
    the GPUs the run used, or this machine's where the run used one) with their predicted step,
    and the best one's settings; False when no split is valid and fits."""
    from rich.markup import escape
    from rich.table import Table

    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise UserError(
            f"--gpu-memory-gib {gpu_memory_gib}: a GPU's memory is above 0 GiB (80 for an H100)"
        )
    times, layout, recorded, steps_file = read_run(run_dir)
    if gpus is None:
        gpus = layout.gpus if layout.gpus >= 2 else max(layout.gpus, gpu_count() or 0)
    if gpus < 2:
        raise UserError(
            f"the run used {layout.gpus} GPU and this machine has no more: pass --gpus N "
            "(at least 2: one for the trainer, one for the rollout)"
        )
    capacity = int(gpu_memory_gib * GIB) if gpu_memory_gib else card_bytes(workflow)

    mode = "asynchronous" if times.asynchronous else "synchronous"
    where = "colocated" if layout.colocated else "disaggregated"
    console.print(
        f"run {display_path(run_dir)}: {mode}, {where}, trainer on {layout.trainer_gpus} GPU(s), "
        f"rollout on {layout.rollout_gpus}; medians of {times.steps} step(s) of "
        f"{display_path(steps_file)}"
        + (" (the first step left out)" if times.first_left_out else ""),
        markup=False,
    )
    console.print(
        f"measured: rollout {times.rollout:.3g} s (p90 {times.rollout_p90:.3g}), reward "
        f"{times.reward:.3g} s, logprobs+train {times.trainer:.3g} s, sync {times.sync:.3g} s, "
        f"driver {times.driver:.3g} s; step {times.step:.3g} s",
        markup=False,
    )
    if not times.first_left_out:
        console.print(
            "[yellow]note[/yellow]: only the first step was logged: its compiles and warm-up "
            "count, and the prediction is long; a run of a few steps more tells the steady state"
        )
    differences = _differences(recorded, workflow)
    if differences:
        shown = "; ".join(differences[:3]) + ("; ..." if len(differences) > 3 else "")
        console.print(
            f"[yellow]warning[/yellow]: the workflow differs from the run's beyond its layout "
            f"({escape(shown)}): the run's phase times may not hold for it"
        )
    own = (
        predict_colocated(times, layout, layout.trainer_gpus)
        if layout.colocated
        else predict(times, layout, layout.trainer_gpus, layout.rollout_gpus)
    )
    own_step = own.step if times.asynchronous or layout.colocated else own.on_policy_step
    console.print(
        f"the model at the run's own layout: {own_step:.3g} s a step (measured {times.step:.3g})",
        markup=False,
    )

    rows = []
    for prediction in candidates(times, layout, gpus):
        candidate = candidate_workflow(workflow, prediction, prediction.staleness)
        # Validity and memory do not depend on the staleness: checked on-policy, so that a
        # setting asynchronous rollout also needs (e.g. tis_cap) is named once, below.
        layout_only = candidate_workflow(workflow, prediction, 0)
        rows.append((prediction, candidate, check_fit(layout_only, host, capacity)))

    table = Table(title=f"trainer + rollout GPUs of {gpus}, predicted from the run's phase times")
    columns: tuple[str, ...] = (
        "split",
        "staleness",
        "trainer s",
        "rollout s",
        "sync s",
        "step s",
        "steps/h",
    )
    columns += ("trainer idle", "rollout idle", "on-policy s", "memory")
    for column in columns:
        table.add_column(column, justify="left" if column in ("split", "memory") else "right")
    for prediction, _, fit in rows:
        if not fit.valid:
            memory = "[red]invalid[/red]"
        elif fit.fits is None:
            memory = f"peak {gib(fit.peak or 0)} GiB"
        elif fit.fits:
            memory = f"[green]fits[/green], {gib(fit.peak or 0)} GiB"
        else:
            memory = f"[red]does not fit[/red], {gib(fit.peak or 0)} GiB"
        table.add_row(
            prediction.label,
            str(prediction.staleness),
            _secs(prediction.trainer_side),
            _secs(prediction.rollout_side),
            _secs(prediction.sync),
            _secs(prediction.step),
            f"{prediction.steps_per_hour:.0f}",
            _share(prediction.trainer_idle),
            _share(prediction.rollout_idle),
            _secs(prediction.on_policy_step),
            memory,
        )
    console.print(table)
    for prediction, _, fit in rows:
        if fit.reason:
            console.print(f"[dim]{prediction.label}: {escape(fit.reason)}[/dim]")
    if capacity is None:
        console.print(
            "no GPU here: pass --gpu-memory-gib (80 for an H100) to check each split's memory"
        )

    chosen = best_split([(p, fit) for p, _, fit in rows])
    if chosen is None:
        console.print(f"[red]no split of {gpus} GPUs is valid and fits[/red] (reasons above)")
        return False
    best, best_workflow = next((p, w) for p, w, _ in rows if p is chosen)
    if best.rollout_side > best.trainer_side:
        why = "the rollout is the long pole: staleness beyond 1 would bank nothing"
    elif best.staleness > 1:
        why = f"its slow (p90) batches outlast {best.staleness - 1}+ trainer steps"
    else:
        why = "a batch rolls out within one trainer step"
    console.print(
        f"best split: {best.trainer_gpus} trainer + {best.rollout_gpus} rollout GPUs, "
        f"max_staleness {best.staleness} ({why}): {best.step:.3g} s a step, "
        f"{best.steps_per_hour:.0f} steps/h; idle trainer {_share(best.trainer_idle)}, "
        f"rollout {_share(best.rollout_idle)}",
        markup=False,
    )
    if layout.colocated and layout.gpus == gpus:
        # The colocated row is the run itself, as measured: the split's gain over it.
        console.print(
            f"against the run's own colocated layout ({times.step:.3g} s a step): "
            f"{times.step / best.step:.2f}x the steps per hour",
            markup=False,
        )
    else:
        console.print(
            f"[dim]note: the {gpus} colocated row assumes every phase speeds up over all "
            f"{gpus} GPUs and no time to switch roles on a GPU: the model's most optimistic "
            "row, never the recommendation[/dim]"
        )
    console.print("set in the workflow (each key in its section):")
    for line in yaml_lines(best_workflow):
        console.print(f"  {line}", markup=False, highlight=False)
    overrides = " ".join(
        f'--set "{line.replace(": ", "=", 1)}"' for line in yaml_lines(best_workflow)
    )
    console.print(f"or on the command line: {overrides}", markup=False, highlight=False)
    for error in validation_errors(best_workflow, host):
        console.print(f"[yellow]also needed[/yellow]: {escape(error)}")
    return True
