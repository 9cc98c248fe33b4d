"""Which roles share rank processes: the core's default plan (the hybrid engine).

Roles mapped to the same devices, rank for rank, live in one set of rank processes when every
strategy involved declares ``Capabilities.shares_process``; the others keep a set of their own.
"""

from __future__ import annotations

from posttrain import hookimpl


@hookimpl(trylast=True)
def posttrain_plan_processes(workflow, strategies):
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


def _can_join(roles, strategies, members: list[str]) -> bool:
    return all(
        (spec := strategies.get(roles[m].strategy_args.strategy_name)) is not None
        and spec.capabilities.shares_process
        for m in members
    )
