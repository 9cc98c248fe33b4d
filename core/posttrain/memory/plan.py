"""The memory plan: every GPU's estimated peak by phase of a step, before any process starts.

Each role's strategy estimates its own share (``posttrain_estimate_memory``). A GPU holds, in
each phase, the resident memory of every role placed on it (a role that is not working keeps
what its ``release_memory`` does not free) plus what the working role needs on top. Roles that
work in one phase one after the other (the trainer's and the reference's scoring) add the
largest of their needs, not the sum.

``posttrain plan`` prints it; ``posttrain run`` refuses a workflow whose plan does not fit the
GPUs, and resolves from it ``model_args.disable_gradient_checkpointing: auto`` and the
strategies' release knobs left at ``auto`` (``param_offload`` and the like), so that a workflow
fits by itself where some setting would make it fit (:func:`resolve_memory`).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.sections import RoleConfig, Workflow
from posttrain.memory.estimate import GIB, MemoryQuery, RoleMemory, Workload
from posttrain.memory.geometry import ModelGeometry, read_geometry

if TYPE_CHECKING:
    from posttrain.host.plugin_host import PluginHost

PHASES = ("rollout", "logprobs", "train", "weight_sync")
# The roles a weight sync makes resident together.
SYNC_ROLES = ("actor_train", "actor_infer")
# Share of the card a plan may fill: the CUDA context, the caching allocator's fragmentation and
# NCCL's buffers take the rest (2-4 GiB on an 80 GB card, measured).
USABLE_SHARE = 0.92
# ``auto`` checkpointing turns on when the plan without it fills more than this share.
RECOMPUTE_SHARE = 0.85


@attrs.frozen(kw_only=True)
class PhasePeak:
    """GPU ``device``'s estimated memory in ``phase``, by ``(role, part)``."""

    device: int
    phase: str
    parts: dict[tuple[str, str], int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@attrs.frozen(kw_only=True)
class MemoryPlan:
    roles: dict[str, RoleMemory]
    peaks: list[PhasePeak]
    capacity: int | None  # bytes of one GPU; None where unknown (no GPU here)
    notes: tuple[str, ...] = ()  # roles left out, and why

    def worst(self) -> PhasePeak | None:
        return max(self.peaks, key=lambda p: p.total, default=None)

    def usable(self) -> int | None:
        return int(self.capacity * USABLE_SHARE) if self.capacity else None

    def over(self) -> list[PhasePeak]:
        """The (GPU, phase) peaks above the usable share of the card, worst first."""
        usable = self.usable()
        if usable is None:
            return []
        return sorted((p for p in self.peaks if p.total > usable), key=lambda p: -p.total)

    def knobs(self, roles: Iterable[str]) -> list[str]:
        return [knob for role in roles for knob in self.roles[role].knobs]


def workload_of(workflow: Workflow) -> Workload:
    infer = workflow.actor_infer
    generating = infer.generating_args if infer is not None else None
    algorithm = workflow.algorithm
    return Workload(
        rows=algorithm.rollout_batch_size * algorithm.group_size,
        prompt_tokens=workflow.data.max_prompt_length,
        response_tokens=generating.max_new_tokens if generating is not None else 0,
        bucket_bytes=workflow.trainer.weight_sync_bucket_mb * 2**20,
        mini_batches=algorithm.num_mini_batches,
        samples_per_prompt=algorithm.group_size,
    )


def estimate_roles(
    workflow: Workflow, host: PluginHost, device: str = "cuda"
) -> tuple[dict[str, RoleMemory], list[str]]:
    """Each role's estimate from its strategy's plugin, and a note for each role without one."""
    workload = workload_of(workflow)
    estimates: dict[str, RoleMemory] = {}
    notes: list[str] = []
    geometries: dict[str | None, ModelGeometry | None] = {}
    for name, role in workflow.roles().items():
        model = role.model_args.model_name_or_path
        if model not in geometries:
            geometries[model] = read_geometry(model)
        geometry = geometries[model]
        if geometry is None:
            notes.append(f"{name}: the geometry of {model!r} is unknown here (no config.json)")
            continue
        query = MemoryQuery(
            role_name=name,
            role=role,
            config=role.strategy_args.strategy_config,
            geometry=geometry,
            workload=workload,
            device=device,
        )
        estimate = host.hook.posttrain_estimate_memory(query=query)
        if estimate is None:
            notes.append(f"{name}: strategy {role.strategy_args.strategy_name} gives no estimate")
            continue
        estimates[name] = estimate
    return estimates, notes


def combine(
    roles: dict[str, RoleConfig], estimates: dict[str, RoleMemory], bucket_bytes: int
) -> list[PhasePeak]:
    """Every GPU's peak in every phase some role on it works in."""
    devices = sorted({d for name in estimates for d in roles[name].device_mapping})
    peaks = []
    for device in devices:
        here = {n: e for n, e in estimates.items() if device in roles[n].device_mapping}
        for phase in PHASES:
            working = _working(here, phase)
            if not working:
                continue
            parts: dict[tuple[str, str], int] = {}
            for name, estimate in here.items():
                for part, size in estimate.held(active=name in working).items():
                    parts[(name, part)] = size
            if phase == "weight_sync":
                # A bucket gathered by the trainer and its copy on the rollout's side (a small
                # model fits one bucket).
                model = here["actor_infer"].resident.get("weights", bucket_bytes)
                parts[("sync", "buckets")] = 2 * min(bucket_bytes, model)
            else:
                name, need = max(
                    ((n, here[n].phases[phase]) for n in working),
                    key=lambda item: sum(item[1].values()),
                )
                for part, size in need.items():
                    parts[(name, part)] = size
            peaks.append(PhasePeak(device=device, phase=phase, parts=parts))
    return peaks


def _working(estimates: dict[str, RoleMemory], phase: str) -> list[str]:
    if phase == "weight_sync":
        both = [n for n in SYNC_ROLES if n in estimates]
        return both if len(both) == 2 else []
    return [n for n, e in estimates.items() if phase in e.phases]


def plan_memory(
    workflow: Workflow, host: PluginHost, capacity: int | None = None, device: str = "cuda"
) -> MemoryPlan:
    estimates, notes = estimate_roles(workflow, host, device)
    roles = workflow.roles()
    peaks = combine(roles, estimates, workload_of(workflow).bucket_bytes)
    return MemoryPlan(roles=estimates, peaks=peaks, capacity=capacity, notes=tuple(notes))


def with_recompute(workflow: Workflow, on: bool) -> Workflow:
    """``workflow`` with every ``auto`` checkpointing setting resolved to ``on``."""
    changes: dict[str, Any] = {}
    for name in workflow.roles():
        # The workflow's own section (the reward's is a RewardConfig, not the role view).
        section = getattr(workflow, name)
        if section.model_args.disable_gradient_checkpointing == "auto":
            model_args = attrs.evolve(section.model_args, disable_gradient_checkpointing=not on)
            changes[name] = attrs.evolve(section, model_args=model_args)
    return attrs.evolve(workflow, **changes) if changes else workflow


def resolve_recompute(workflow: Workflow, host: PluginHost, capacity: int | None) -> Workflow:
    """``auto`` checkpointing resolved: on where the plan without it would fill more than
    ``RECOMPUTE_SHARE`` of a GPU, off elsewhere (and on the CPU, where memory is the host's)."""
    without = with_recompute(workflow, on=False)
    if capacity is None or without is workflow:
        return without
    worst = plan_memory(without, host, capacity).worst()
    if worst is not None and worst.total > RECOMPUTE_SHARE * capacity:
        return with_recompute(workflow, on=True)
    return without


def with_release(
    workflow: Workflow, estimates: dict[str, RoleMemory], turned_on: dict[str, set[str]]
) -> Workflow:
    """``workflow`` with the release knobs its roles' ``estimates`` left at ``auto`` resolved:
    true for the fields in ``turned_on`` (role -> config fields), false for the others."""
    changes: dict[str, Any] = {}
    for name, estimate in estimates.items():
        if not estimate.auto_release:
            continue
        section = getattr(workflow, name)
        chosen = turned_on.get(name, set())
        config = attrs.evolve(
            section.strategy_args.strategy_config,
            **{field: field in chosen for field in estimate.auto_release},
        )
        strategy_args = attrs.evolve(section.strategy_args, strategy_config=config)
        changes[name] = attrs.evolve(section, strategy_args=strategy_args)
    return attrs.evolve(workflow, **changes) if changes else workflow


def resolve_release(workflow: Workflow, host: PluginHost, capacity: int | None) -> Workflow:
    """Release knobs left at ``auto`` resolved: off where the plan fits without them; else
    turned on one at a time, the one freeing most first, until it fits. A knob that lowers no
    peak over the card stays off; if the plan is still over with the rest on, it refuses the
    workflow, naming what is left. On the CPU (no capacity) they stay
    ``auto``, which the engines read as off: memory there is the host's."""
    if capacity is None:
        return workflow
    plan = plan_memory(workflow, host, capacity)
    estimates = plan.roles
    candidates = sorted(
        (
            (sum(estimate.resident.get(part, 0) for part in parts), name, field)
            for name, estimate in estimates.items()
            for field, parts in estimate.auto_release.items()
        ),
        reverse=True,
    )
    turned_on: dict[str, set[str]] = {}
    for _size, name, field in candidates:
        if not plan.over():
            break
        trial = {**turned_on, name: turned_on.get(name, set()) | {field}}
        tried = plan_memory(with_release(workflow, estimates, trial), host, capacity)
        # Only a knob that lowers what is over the card: a role alone on its GPUs (a
        # disaggregated rollout) gains nothing from a host round trip each step.
        if overage(tried) < overage(plan):
            turned_on, plan = trial, tried
    return with_release(workflow, estimates, turned_on)


def overage(plan: MemoryPlan) -> int:
    """Bytes above the usable share of the card, summed over the (GPU, phase) peaks over it."""
    usable = plan.usable() or 0
    return sum(peak.total - usable for peak in plan.over())


def resolve_memory(workflow: Workflow, host: PluginHost, capacity: int | None) -> Workflow:
    """Every ``auto`` the memory plan decides, resolved: activation checkpointing first (it
    costs compute inside the step), then the release knobs (a host round trip each step)."""
    return resolve_release(resolve_recompute(workflow, host, capacity), host, capacity)


def gpu_memory_bytes() -> int | None:
    """The memory of this machine's first GPU, from ``nvidia-smi`` (the driver never touches
    CUDA itself: a context would take memory from the ranks); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[:1]
    return int(float(first[0]) * 2**20) if first and first[0].strip() else None


def card_bytes(workflow: Workflow) -> int | None:
    """The GPU memory a run may use: ``cluster.gpu_memory_gib``, else this machine's card."""
    cap = workflow.cluster.gpu_memory_gib
    return int(cap * GIB) if cap else gpu_memory_bytes()


def gib(size: int) -> str:
    return f"{size / GIB:.1f}"


def refusal(plan: MemoryPlan) -> str | None:
    """Why ``plan`` cannot run, naming the GPUs and phases over the card and the knobs that
    shrink them; None when it fits (or the card is unknown)."""
    over = plan.over()
    if not over:
        return None
    lines = [
        f"the memory plan does not fit the GPUs ({gib(plan.capacity or 0)} GiB each, "
        f"{USABLE_SHARE:.0%} usable):"
    ]
    for peak in over[:4]:
        biggest = sorted(peak.parts.items(), key=lambda kv: -kv[1])[:4]
        detail = ", ".join(f"{role} {part} {gib(size)}" for (role, part), size in biggest)
        lines.append(f"  GPU {peak.device}, {peak.phase}: {gib(peak.total)} GiB ({detail})")
    roles = sorted({role for p in over for (role, _) in p.parts if role in plan.roles})
    knobs = plan.knobs(roles)
    if knobs:
        lines.append("what would shrink it:")
        lines += [f"  {knob}" for knob in dict.fromkeys(knobs)]
    lines.append("`posttrain plan WORKFLOW` prints the whole plan")
    return "\n".join(lines)
