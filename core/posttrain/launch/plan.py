"""Which processes a run starts, and starting them.

The process plan says which roles share rank processes (``posttrain_plan_processes``; the core's
default, registered ``trylast``, is the hybrid engine: roles mapped to the same devices, rank
for rank, share one set of processes when every strategy involved declares
``Capabilities.shares_process``). The launcher (local processes or Ray actors) starts each set.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from posttrain.backends.distributed import COLLECTIVE_TIMEOUT_ENV
from posttrain.config.sections import ROLE_HEADS, RoleConfig, Workflow
from posttrain.errors import UserError
from posttrain.launch.base import GroupSpec, Launcher, WorkerGroup
from posttrain.markers import hookimpl
from posttrain.training.lr_schedule import with_schedule

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.host.plugin_host import PluginHost
    from posttrain.host.strategy import StrategySpec
    from posttrain.launch.hang_watch import HangWatch


def resolve_device(workflow: Workflow) -> str:
    """``cluster.device``, with ``auto`` settled: ``cuda`` when torch sees a GPU, else ``cpu``."""
    if workflow.cluster.device != "auto":
        return workflow.cluster.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_launcher(workflow: Workflow, plan: list[tuple[str, ...]]) -> Launcher:
    """The workflow's launcher; ``plan`` lists the roles each set of rank processes hosts."""
    cluster = workflow.cluster
    if cluster.launcher == "local":
        from posttrain.launch.local import LocalLauncher

        return LocalLauncher(
            call_timeout_s=cluster.call_timeout_s, start_timeout_s=cluster.start_timeout_s
        )
    if cluster.launcher == "ray":
        from posttrain.launch.ray import RayLauncher

        return RayLauncher(cluster, workflow.roles(), resolve_device(workflow), plan)
    raise UserError(f"cluster.launcher: '{cluster.launcher}' is not available; use local or ray")


def plan_processes(workflow: Workflow, host: PluginHost) -> list[tuple[str, ...]]:
    """Which roles share rank processes (``posttrain_plan_processes``), checked to cover every
    role once with equal device mappings inside a set."""
    roles = workflow.roles()
    plan = [
        tuple(m)
        for m in host.hook.posttrain_plan_processes(workflow=workflow, strategies=host.strategies())
    ]
    listed = [name for members in plan for name in members]
    if sorted(listed) != sorted(roles):
        raise UserError(f"the process plan {plan} must name every role once ({', '.join(roles)})")
    for members in plan:
        mappings = {(roles[m].device_mapping, roles[m].num_ranks) for m in members}
        if len(mappings) > 1:
            raise UserError(
                f"the process plan puts {', '.join(members)} in the same processes, but their "
                "device mappings differ"
            )
    return plan


def group_spec(
    workflow: Workflow,
    role_name: str,
    role: RoleConfig,
    run_dir: str,
    device: str,
    processes: int | None = None,
) -> GroupSpec:
    """``processes``: how many rank processes the whole run starts (default: one per rank of
    every role), among which CPU threads are shared."""
    threads = workflow.cluster.threads_per_worker
    if threads is None and device == "cpu":
        # Share the machine's cores between every rank instead of oversubscribing them.
        ranks = processes or sum(r.num_ranks for r in workflow.roles().values())
        threads = max(1, (os.cpu_count() or 1) // ranks)
    return GroupSpec(
        role=role_name,
        config=with_schedule(role, workflow),
        algorithm=workflow.algorithm,
        seed=workflow.trainer.seed,
        run_dir=run_dir,
        base_dir=workflow.base_dir,
        device=device,
        plugins=tuple(workflow.plugins),
        threads=threads,
        env=rank_env(workflow, run_dir, device),
        head=ROLE_HEADS.get(role_name, "lm"),
        gpu_memory_gib=workflow.cluster.gpu_memory_gib,
    )


def rank_env(workflow: Workflow, run_dir: str, device: str) -> dict[str, str]:
    """The environment every rank gets: the process groups' timeout and, on GPUs, NCCL's flight
    recorder (dumped under RUN_DIR/hangs/ when a collective times out); then the workflow's
    ``cluster.runtime_env.env_vars``, which override these."""
    env = {COLLECTIVE_TIMEOUT_ENV: str(workflow.cluster.collective_timeout())}
    if device == "cuda":
        env |= {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(run_dir, "hangs", "nccl_trace_rank_"),
        }
    env |= {str(k): str(v) for k, v in workflow.cluster.runtime_env.get("env_vars", {}).items()}
    return env


def start_groups(
    workflow: Workflow,
    host: PluginHost,
    run_dir: str,
    device: str,
    console: Console,
    watch: HangWatch | None = None,
) -> tuple[Launcher, dict[str, WorkerGroup]]:
    """Start every role's ranks as the plan groups them (printing each set as it starts);
    ``watch``: the driver's :class:`~posttrain.launch.hang_watch.HangWatch`, from the roles'
    set-up on."""
    from posttrain.launch.local import preload_in_fork_server

    roles = workflow.roles()
    plan = plan_processes(workflow, host)
    preload_in_fork_server(host.fork_preload(r.strategy_args.strategy_name for r in roles.values()))
    launcher = make_launcher(workflow, plan)
    where = launcher.description()
    if where:
        console.print(where, markup=False, highlight=False)
    if watch is not None:
        launcher.hang_watch, watch.launcher = watch, launcher
    processes = sum(roles[members[0]].num_ranks for members in plan)
    groups: dict[str, WorkerGroup] = {}
    try:
        for members in plan:
            t0 = time.perf_counter()
            specs = [
                group_spec(workflow, name, roles[name], run_dir, device, processes)
                for name in members
            ]
            groups.update(launcher.start_processes(specs))
            what = " + ".join(
                f"{name} ({roles[name].strategy_args.strategy_name})" for name in members
            )
            ranks = roles[members[0]].num_ranks
            count = f"{ranks} rank process{'es' if ranks > 1 else ''}"
            shared = ", shared" if len(members) > 1 else ""
            console.print(f"started {what}: {count}{shared} ({time.perf_counter() - t0:.1f}s)")
            placement = launcher.placement_of_last()
            if placement:
                console.print(f"  {placement}", markup=False, highlight=False)
    except BaseException:
        launcher.shutdown()
        raise
    return launcher, groups


@hookimpl(trylast=True)
def posttrain_plan_processes(
    workflow: Workflow, strategies: dict[str, StrategySpec]
) -> list[tuple[str, ...]]:
    """The hybrid engine: roles on the same devices (rank for rank) share processes when every
    strategy involved can; ``cluster.colocation: separate`` keeps one set per role."""
    roles = workflow.roles()
    if workflow.cluster.colocation == "separate":
        return [(name,) for name in roles]
    plan: list[list[str]] = []
    for name, role in roles.items():
        spec = strategies.get(role.strategy_args.strategy_name)
        shares = spec is not None and spec.capabilities.shares_process
        home = next(
            (
                members
                for members in plan
                if shares
                and _can_join(roles, strategies, members)
                and roles[members[0]].device_mapping == role.device_mapping
                and roles[members[0]].num_ranks == role.num_ranks
            ),
            None,
        )
        if home is None:
            plan.append([name])
        else:
            home.append(name)
    return [tuple(members) for members in plan]


def _can_join(
    roles: dict[str, RoleConfig], strategies: dict[str, StrategySpec], members: list[str]
) -> bool:
    return all(
        (spec := strategies.get(roles[m].strategy_args.strategy_name)) is not None
        and spec.capabilities.shares_process
        for m in members
    )
