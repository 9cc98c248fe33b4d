"""The ``ray`` launcher: each rank is a Ray actor placed in a placement group built from
``device_mapping``.

Roles whose device mappings overlap share one placement group (one bundle per device of the
larger mapping) and time-share its bundles; a mapping that only partly overlaps another is
refused by ``posttrain validate``. Roles the process plan puts together (the hybrid engine) are
hosted by one actor per rank. Ranks set up torch.distributed themselves from MASTER_ADDR /
MASTER_PORT / RANK / WORLD_SIZE / LOCAL_RANK, as with the local launcher.

Imported only when a workflow says ``cluster: {launcher: ray}``: ``posttrain validate`` never
imports Ray.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group

from posttrain.config.sections import ClusterConfig, RoleConfig
from posttrain.errors import UserError
from posttrain.launch.base import (
    GroupSpec,
    Launcher,
    WorkerGroup,
    partial_overlaps,
)
from posttrain.launch.ray_ranks import Placement, RayProcesses, RayWorkerGroup


def _round_down(value: float) -> float:
    """Ray accepts resource fractions to 4 decimals; never round a share up past its bundle."""
    return math.floor(value * 10_000) / 10_000


def _runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any] | None:
    """The workflow's runtime_env for Ray: env_vars values as strings (YAML gives ints)."""
    if not runtime_env:
        return None
    env = dict(runtime_env)
    if "env_vars" in env:
        env["env_vars"] = {str(k): str(v) for k, v in (env["env_vars"] or {}).items()}
    return env


class RayLauncher(Launcher):
    def __init__(
        self,
        cluster: ClusterConfig,
        roles: dict[str, RoleConfig],
        device: str,
        plan: list[tuple[str, ...]] | None = None,
    ):
        """``plan``: the roles each set of rank processes hosts (default: one set per role)."""
        super().__init__(cluster.call_timeout_s, cluster.start_timeout_s)
        self.cluster = cluster
        self.device = device
        self.placement_groups: list = []
        self.placements: dict[tuple[str, ...], Placement] = {}
        self.owns_ray = False
        self.temp_dir: str | None = None
        self.where = ""  # which Ray cluster, for description()
        self._init_ray()
        try:
            self._place(roles, plan or [(name,) for name in roles])
        except BaseException:
            self.shutdown()
            raise

    # -- Ray itself ------------------------------------------------------------------------

    def _init_ray(self) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import logging

        c = self.cluster
        common: dict[str, Any] = {
            "log_to_driver": False,
            "logging_level": logging.WARNING,
            "runtime_env": _runtime_env(c.runtime_env),
        }
        if ray.is_initialized():  # e.g. a driver that runs posttrain from its own Ray job
            self.where = "the Ray session this process had started"
            return
        if c.address is None:
            # A short temp dir: Ray's socket paths must stay under 108 characters.
            self.temp_dir = tempfile.mkdtemp(prefix="ptray-", dir="/tmp")
            ray.init(
                address="local",
                num_cpus=c.num_cpus or os.cpu_count() or 1,
                num_gpus=None if self.device == "cuda" else 0,
                include_dashboard=False,
                object_store_memory=c.object_store_memory,
                _temp_dir=self.temp_dir,
                **common,
            )
            self.owns_ray = True
            self.where = "a local cluster started for this run"
        else:
            ray.init(address=c.address, **common)
            self.where = f"cluster.address {c.address}"

    def description(self) -> str:
        """``ray: ADDRESS, N nodes (C CPUs, G GPUs)``: which cluster the run's ranks are on."""
        alive = [node for node in ray.nodes() if node.get("Alive")]
        resources = ray.cluster_resources()
        address = ray.get_runtime_context().gcs_address
        return (
            f"ray: {self.where} ({address}), {len(alive)} node{'s' if len(alive) != 1 else ''} "
            f"({resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs); the ranks' "
            "logs go to RUN_DIR/logs/ on their nodes"
        )

    # -- placement -------------------------------------------------------------------------

    def _place(self, roles: dict[str, RoleConfig], plan: list[tuple[str, ...]]) -> None:
        """One placement group per set of overlapping mappings (one bundle per device of the
        largest mapping); every set of rank processes gets the bundle of each rank's device."""
        problems = partial_overlaps(roles)
        if problems:
            raise UserError("; ".join(message for _, _, message in problems))
        # A unit is one set of rank processes: the roles it hosts share a mapping.
        units = {members: roles[members[0]] for members in plan}
        components: list[tuple[tuple[int, ...], list[tuple[str, ...]]]] = []
        for unit in sorted(units, key=lambda u: -len(set(units[u].device_mapping))):
            devices = set(units[unit].device_mapping)
            for owner, members in components:
                if devices & set(owner):
                    members.append(unit)
                    break
            else:
                components.append((tuple(dict.fromkeys(units[unit].device_mapping)), [unit]))
        total_bundles = sum(len(devs) for devs, _ in components)
        gpu = self.device == "cuda"
        available = ray.cluster_resources().get("CPU", 1.0)
        # Never let actors hold every logical CPU: half of them at most, one per bundle at most.
        bundle_cpu = max(0.01, _round_down(min(1.0, available / (2 * total_bundles))))
        for devices, members in components:
            bundle = {"CPU": bundle_cpu, **({"GPU": 1.0} if gpu else {})}
            pg = placement_group([dict(bundle) for _ in devices], strategy="PACK")
            self.placement_groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=self.start_timeout_s)
            except GetTimeoutError:
                names = ", ".join("+".join(unit) for unit in members)
                raise UserError(
                    f"cluster: a placement group of {len(devices)} x {bundle} bundles (devices "
                    f"{list(devices)} of {names}) was not placed within "
                    f"{self.start_timeout_s:.0f}s; the cluster has {ray.cluster_resources()}"
                ) from None
            sharers = {d: 0 for d in devices}
            for unit in members:
                mapping = units[unit].device_mapping
                for r in range(units[unit].num_ranks):
                    sharers[mapping[r % len(mapping)]] += 1
            for unit in members:
                mapping = units[unit].device_mapping
                ranks = range(units[unit].num_ranks)
                dev = [mapping[r % len(mapping)] for r in ranks]
                self.placements[unit] = Placement(
                    pg,
                    [devices.index(d) for d in dev],
                    [_round_down(bundle_cpu / sharers[d]) for d in dev],
                    [_round_down(1.0 / sharers[d]) if gpu else 0 for d in dev],
                )

    # -- Launcher --------------------------------------------------------------------------

    def _make_processes(self, specs: list[GroupSpec]) -> tuple[Any, dict[str, WorkerGroup]]:
        unit = tuple(spec.role for spec in specs)
        placement = self.placements.get(unit)
        if placement is None:
            raise UserError(f"{'+'.join(unit)}: no placement was made for these roles")
        processes = RayProcesses(specs, placement, self.call_timeout_s, self.start_timeout_s)
        return processes, {spec.role: RayWorkerGroup(processes, spec) for spec in specs}

    def shutdown(self) -> None:
        super().shutdown()
        if ray.is_initialized():
            for pg in self.placement_groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
        self.placement_groups.clear()
        if self.owns_ray:
            self.owns_ray = False
            with contextlib.suppress(Exception):
                ray.shutdown()
            if self.temp_dir:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
