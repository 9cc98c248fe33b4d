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
import inspect
import ipaddress
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import attrs
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


# The label every Ray node carries (Ray 2.60 does), which a bundle's label selector pins it by.
NODE_ID_LABEL = "ray.io/node-id"


@attrs.frozen
class Node:
    """A live Ray node, as placement sees it."""

    node_id: str
    ip: str
    head: bool
    cpus: float
    gpus: float
    labels: dict[str, str] = attrs.field(factory=dict, eq=False)

    def label(self) -> str:
        return f"{self.ip} [Ray node {self.node_id[:8]}]"


def live_nodes(described: list[dict[str, Any]]) -> list[Node]:
    """The live nodes of ``ray.nodes()``, in the order devices_per_node fills them: the head
    first, then by IP, then by node id (two nodes of one host share an IP)."""
    nodes = [
        Node(
            node_id=n["NodeID"],
            ip=n.get("NodeManagerAddress", "?"),
            head="node:__internal_head__" in n.get("Resources", {}),
            cpus=n.get("Resources", {}).get("CPU", 0.0),
            gpus=n.get("Resources", {}).get("GPU", 0.0),
            labels=dict(n.get("Labels") or {}),
        )
        for n in described
        if n.get("Alive")
    ]

    def order(node: Node) -> tuple:
        try:
            ip: tuple = (0, ipaddress.ip_address(node.ip))
        except ValueError:
            ip = (1, node.ip)
        return (not node.head, ip, node.node_id)

    return sorted(nodes, key=order)


def nodes_for_devices(
    devices: Iterable[int], per_node: int, nodes: list[Node], gpu: bool, where: str
) -> dict[int, Node]:
    """``cluster.devices_per_node``: device ``d`` of the device mappings on the ``d //
    per_node``-th node that can host ``per_node`` devices (every node with CPUs on CPU runs;
    on GPU runs, nodes with at least ``per_node`` GPUs). ``where``: the cluster, for the
    error."""
    devices = sorted(set(devices))
    able = [n for n in nodes if (n.gpus >= per_node if gpu else n.cpus > 0)]
    needed = devices[-1] // per_node + 1
    if needed > len(able):
        kind = f"at least {per_node} GPUs" if gpu else "CPUs"
        first, last = per_node * (needed - 1), per_node * needed - 1
        span = f" (its devices {first}-{last})" if per_node > 1 else ""
        have = ", ".join(
            f"{n.label()}: {n.gpus:g} GPUs" if gpu else f"{n.label()}: {n.cpus:g} CPUs"
            for n in nodes
        )
        # Fewer, larger nodes: the devices_per_node that the nodes there are would take.
        fewer = -(-(devices[-1] + 1) // len(able)) if able else None
        if fewer and gpu and sum(n.gpus >= fewer for n in nodes) * fewer <= devices[-1]:
            fewer = None
        raise UserError(
            f"cluster.devices_per_node: {per_node} puts device_mapping device {devices[-1]} on "
            f"node {needed}{span}, but "
            f"{where} has {len(able)} node{'s' if len(able) != 1 else ''} with {kind} "
            f"({have or 'none alive'}); start {needed - len(able)} more "
            "(ray start --address=HEAD_IP:PORT on each: docs/multi-node.md)"
            + (f", or set cluster.devices_per_node to {fewer} or more" if fewer else "")
        )
    return {d: able[d // per_node] for d in devices}


def _check_label_selectors(nodes: Iterable[Node]) -> None:
    """Pinning a bundle to a node takes bundle label selectors and the node-id label."""
    parameters = inspect.signature(placement_group).parameters
    if "bundle_label_selector" not in parameters or any(
        NODE_ID_LABEL not in n.labels for n in nodes
    ):
        raise UserError(
            f"cluster.devices_per_node: placing devices on given nodes needs Ray's bundle "
            f"label selectors and the {NODE_ID_LABEL} node label (tested with Ray 2.60); this "
            f"is Ray {ray.__version__}: upgrade ray on every node, or leave devices_per_node "
            "out (Ray then packs each role's bundles)"
        )


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
            mapped = set(units[unit].device_mapping)
            for owner, members in components:
                if mapped & set(owner):
                    members.append(unit)
                    break
            else:
                components.append((tuple(dict.fromkeys(units[unit].device_mapping)), [unit]))
        total_bundles = sum(len(devs) for devs, _ in components)
        gpu = self.device == "cuda"
        available = ray.cluster_resources().get("CPU", 1.0)
        # Never let actors hold every logical CPU: half of them at most, one per bundle at most.
        share = available / (2 * total_bundles)
        node_of: dict[int, Node] = {}
        per_node = self.cluster.devices_per_node
        if per_node is not None:
            all_devices = [d for devs, _ in components for d in devs]
            node_of = self._wait_for_nodes(all_devices, per_node, gpu)
            _check_label_selectors(node_of.values())
            # ... and half of each node's CPUs, where the bundles are pinned.
            for node in set(node_of.values()):
                on_node = sum(n is node for n in node_of.values())
                share = min(share, node.cpus / (2 * on_node))
        bundle_cpu = max(0.01, _round_down(min(1.0, share)))
        for devices, members in components:
            bundle = {"CPU": bundle_cpu, **({"GPU": 1.0} if gpu else {})}
            if node_of:
                # Each bundle on its device's node: ranks on one node are consecutive, so a
                # tensor-parallel group of up to devices_per_node ranks stays inside a node.
                selectors = [{NODE_ID_LABEL: node_of[d].node_id} for d in devices]
                pg = placement_group(
                    [dict(bundle) for _ in devices],
                    strategy="PACK",
                    bundle_label_selector=selectors,
                )
            else:
                pg = placement_group([dict(bundle) for _ in devices], strategy="PACK")
            self.placement_groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=self.start_timeout_s)
            except GetTimeoutError:
                names = ", ".join("+".join(unit) for unit in members)
                pinned = ""
                if node_of:
                    pinned = " on nodes " + ", ".join(f"{d}: {node_of[d].label()}" for d in devices)
                raise UserError(
                    f"cluster: a placement group of {len(devices)} x {bundle} bundles (devices "
                    f"{list(devices)} of {names}{pinned}) was not placed within "
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
                    [node_of[d].node_id for d in dev] if node_of else None,
                )

    def _wait_for_nodes(self, devices: list[int], per_node: int, gpu: bool) -> dict[int, Node]:
        """The node of each device, once enough nodes have joined: a job that starts its
        workers and posttrain at once (docs/multi-node.md, SLURM) needs no sleep between."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                return nodes_for_devices(
                    devices, per_node, live_nodes(ray.nodes()), gpu, self.where
                )
            except UserError as exc:
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"{exc} (waited {self.start_timeout_s:.0f}s: cluster.start_timeout_s)"
                    ) from None
            time.sleep(1.0)

    # -- Launcher --------------------------------------------------------------------------

    def _make_processes(self, specs: list[GroupSpec]) -> tuple[Any, dict[str, WorkerGroup]]:
        unit = tuple(spec.role for spec in specs)
        placement = self.placements.get(unit)
        if placement is None:
            raise UserError(f"{'+'.join(unit)}: no placement was made for these roles")
        processes = RayProcesses(specs, placement, self.call_timeout_s, self.start_timeout_s)
        return processes, {spec.role: RayWorkerGroup(processes, spec) for spec in specs}

    def placement_of_last(self) -> str:
        """Which node each rank of the last set of rank processes runs on."""
        return self.process_sets[-1].placement() if self.process_sets else ""

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
