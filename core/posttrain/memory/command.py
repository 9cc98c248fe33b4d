"""``posttrain plan`` and the memory check ``posttrain run`` makes before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.config.sections import Workflow
from posttrain.errors import UserError
from posttrain.memory.estimate import GIB
from posttrain.memory.plan import (
    MemoryPlan,
    card_bytes,
    gib,
    plan_memory,
    refusal,
    resolve_memory,
)

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.host.plugin_host import PluginHost


def checked_for_memory(
    workflow: Workflow, host: PluginHost, device: str, console: Console
) -> Workflow:
    """``workflow`` with its ``auto`` checkpointing and release knobs resolved from the memory
    plan (:func:`resolve_memory`); a workflow whose
    plan does not fit this machine's GPUs is refused (a :class:`UserError` naming the numbers
    and the knobs). On the CPU nothing is refused: memory there is the host's."""
    capacity = card_bytes(workflow) if device == "cuda" else None
    workflow = resolve_memory(workflow, host, capacity)
    if capacity is None:
        return workflow
    plan = plan_memory(workflow, host, capacity)
    why = refusal(plan)
    if why is not None:
        raise UserError(why)
    worst = plan.worst()
    if worst is not None:
        recompute = sorted(
            name
            for name, role in workflow.roles().items()
            if role.training_args is not None
            and role.model_args.disable_gradient_checkpointing is False
        )
        on = f"; activation checkpointing on in {', '.join(recompute)}" if recompute else ""
        released = released_by_plan(plan)
        if released:
            on += f"; released while others run: {released}"
        console.print(
            f"memory plan: peak {gib(worst.total)} of {gib(capacity)} GiB (GPU {worst.device}, "
            f"{worst.phase}){on}",
            markup=False,
        )
    return workflow


def released_by_plan(plan: MemoryPlan) -> str:
    """What each role frees while a colocated role runs, as ``role (parts)``; empty when none."""
    return ", ".join(
        f"{name} ({', '.join(sorted(estimate.released))})"
        for name, estimate in plan.roles.items()
        if estimate.released
    )


def render_plan(plan: MemoryPlan, console: Console) -> None:
    from rich.table import Table

    roles = Table(title="resident memory per GPU, by role (GiB)")
    roles.add_column("role")
    parts = sorted({p for e in plan.roles.values() for p in e.resident})
    for part in parts:
        roles.add_column(part, justify="right")
    roles.add_column("freed while others run")
    for name, estimate in plan.roles.items():
        cells = [gib(estimate.resident[p]) if p in estimate.resident else "-" for p in parts]
        roles.add_row(name, *cells, ", ".join(sorted(estimate.released)) or "-")
    console.print(roles)

    phases = Table(title="estimated peak per GPU and phase (GiB)")
    for column in ("GPU", "phase", "total", "largest parts"):
        phases.add_column(column, justify="right" if column == "total" else "left")
    usable = plan.usable()
    for peak in plan.peaks:
        top = sorted(peak.parts.items(), key=lambda kv: -kv[1])[:4]
        detail = ", ".join(f"{role} {part} {gib(size)}" for (role, part), size in top)
        total = gib(peak.total)
        if usable is not None and peak.total > usable:
            total = f"[red]{total}[/red]"
        phases.add_row(str(peak.device), peak.phase, total, detail)
    console.print(phases)
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")


def print_plan(
    workflow: Workflow, host: PluginHost, console: Console, gpu_memory_gib: float | None
) -> bool:
    """``posttrain plan``: the plan against ``gpu_memory_gib`` (default: this machine's GPU),
    printed; False when it does not fit."""
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise UserError(
            f"--gpu-memory-gib {gpu_memory_gib}: a GPU's memory is above 0 GiB (80 for an H100)"
        )
    capacity = int(gpu_memory_gib * GIB) if gpu_memory_gib else card_bytes(workflow)
    workflow = resolve_memory(workflow, host, capacity)
    plan = plan_memory(workflow, host, capacity)
    render_plan(plan, console)
    for name, role in workflow.roles().items():
        if role.training_args is not None:
            on = role.model_args.disable_gradient_checkpointing is False
            console.print(f"{name}: activation checkpointing {'on' if on else 'off'}")
    released = released_by_plan(plan)
    console.print(f"released while others run: {released or 'nothing'}", markup=False)
    if capacity is None:
        console.print(
            "no GPU here: pass --gpu-memory-gib (80 for an H100) to check the plan against a card"
        )
        return True
    why = refusal(plan)
    if why is not None:
        console.print(f"[red]does not fit[/red]: {why}", markup=True, highlight=False)
        return False
    worst = plan.worst()
    peak = gib(worst.total) if worst else "0"
    console.print(f"[green]fits[/green]: peak {peak} of {gib(capacity)} GiB a GPU")
    return True
