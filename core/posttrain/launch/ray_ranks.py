"""Ranks as Ray actors: one actor per rank of a set of rank processes (every role the set hosts),
placed in a bundle of its placement group, serving the driver's calls as a local rank process
does (:class:`~posttrain.launch.rank_main.RankServer`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.errors import UserError, WorkerError
from posttrain.launch.base import (
    GroupSpec,
    PendingCall,
    WorkerGroup,
    check_same_mapping,
    rank_log_path,
)
from posttrain.launch.fatal import last_words, report_fatal_signals
from posttrain.launch.rank_main import RankServer, describe_error, error_status
from posttrain.launch.stacks import (
    StackTarget,
    install_stack_dump,
    stacks_path_for,
    target,
    this_node,
)
from posttrain.paths import display_path

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

# How long ranks still answering get once one rank failed (they may block in a collective).
PEER_GRACE_S = 10.0
STOP_TIMEOUT_S = 10.0


class RankActor:
    """One worker rank inside a Ray actor process.

    Construction only redirects the process's output to the rank's log; :meth:`start` sets the
    rendezvous environment and builds the :class:`~posttrain.launch.rank_main.RankServer`."""

    def __init__(self, log_path: str):
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the rank)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        install_stack_dump(stacks_path_for(log_path))  # for the hang watchdog, posttrain stacks
        report_fatal_signals(log)  # a crash's stack, for the driver's report (launch/fatal.py)
        self.server: RankServer | None = None

    def node_info(self) -> tuple[str, int, int, str, str]:
        """This actor's node IP, a port free on that node (for the group's rendezvous), its pid,
        its host's name (for its stacks) and its Ray node id (which tells apart two nodes of
        one host)."""
        ip = ray.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1], os.getpid(), this_node(), node_id

    def start(
        self, specs: list[GroupSpec], rank: int, world_size: int, env: dict[str, str]
    ) -> tuple[str, str | None, str]:
        os.environ.update(env)
        try:
            self.server = RankServer(specs, rank, world_size)
        except BaseException as exc:
            traceback.print_exc()
            return ("error", describe_error(exc), traceback.format_exc())
        return ("ok", None, "")

    def stop(self) -> tuple[str, Any, str]:
        return self.handle("", "__stop__", (), {})

    def handle(self, role: str, method: str, args: tuple, kwargs: dict) -> tuple[str, Any, str]:
        try:
            # Made by start(); a rank whose start failed answers this call with the error.
            assert self.server is not None, "the rank did not start"
            if method == "__stop__":
                self.server.shutdown()
                return ("ok", True, "")
            result = self.server.handle(role, method, args, kwargs)
        except BaseException as exc:
            traceback.print_exc()
            return (error_status(exc), describe_error(exc), traceback.format_exc())
        return ("ok", result, "")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-7`` or ``ranks 0, 2, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class _RayPending(PendingCall):
    def __init__(self, processes: RayProcesses, role: str, method: str, refs: list):
        self.processes = processes
        self.role = role
        self.method = method
        self.refs = refs

    def wait(self) -> list[Any]:
        return self.processes.collect(self.role, self.method, self.refs)


class Placement:
    """Where each rank of a role goes: a placement group and a bundle index per rank (and,
    with cluster.devices_per_node, the Ray node id each rank's bundle is pinned to)."""

    def __init__(
        self,
        pg: PlacementGroup,
        bundles: list[int],
        cpus: list[float],
        gpus: list[float],
        node_ids: list[str] | None = None,
    ) -> None:
        self.pg = pg
        self.bundles = bundles
        self.cpus = cpus
        self.gpus = gpus
        self.node_ids = node_ids


class RayProcesses:
    """One actor per rank, hosting the roles of ``specs`` (all on the same devices)."""

    def __init__(
        self,
        specs: list[GroupSpec],
        placement: Placement,
        timeout_s: float,
        start_timeout_s: float,
    ):
        check_same_mapping(specs)
        self.roles = tuple(spec.role for spec in specs)
        first = specs[0]
        self.device = first.device
        self.devices = first.config.device_mapping
        self.world_size = first.config.num_ranks
        self.timeout_s = timeout_s
        self.watch = None  # the driver's HangWatch, once the launcher hands it over
        self.calls = 0
        self.nodes = ["?"] * self.world_size  # each rank's node IP
        self.node_ids = ["?"] * self.world_size  # ... and Ray node id
        self._pids: list[tuple[int, str]] = []  # each rank's (pid, host name)
        self.log_paths = [
            rank_log_path(first.run_dir, self.roles, r) for r in range(self.world_size)
        ]
        self._stopped = False
        self._failed = False
        self.actors = []
        actor_class = ray.remote(RankActor)
        env_extra = {k: v for spec in specs for k, v in spec.env.items()}
        threads = max((spec.threads or 0 for spec in specs), default=0)
        try:
            for rank in range(self.world_size):
                self.actors.append(
                    actor_class.options(
                        name=None,
                        num_cpus=placement.cpus[rank],
                        num_gpus=placement.gpus[rank],
                        max_restarts=0,
                        max_concurrency=1,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=placement.pg,
                            placement_group_bundle_index=placement.bundles[rank],
                        ),
                    ).remote(self.log_paths[rank])
                )
            infos = self.collect(
                self.roles[0],
                "node_info",
                [a.node_info.remote() for a in self.actors],
                timeout_s=start_timeout_s,
                wrapped=False,
            )
            self.nodes = [info[0] for info in infos]
            self._pids = [(info[2], info[3]) for info in infos]
            self.node_ids = [info[4] for info in infos]
            self._check_nodes(placement)
            master_addr, master_port = infos[0][:2]
            refs = []
            for rank, actor in enumerate(self.actors):
                env = {
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.world_size),
                    "LOCAL_RANK": self._local_rank(rank),
                    "LOCAL_WORLD_SIZE": str(self.node_ids.count(self.node_ids[rank])),
                    **env_extra,
                }
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)
                refs.append(actor.start.remote(specs, rank, self.world_size, env))
            self.collect(self.roles[0], "start", refs, timeout_s=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _check_nodes(self, placement: Placement) -> None:
        """Each rank on the node its bundle was pinned to: Ray versions whose placement ignored
        bundle label selectors (ray-project/ray#55590) would put a node's ranks elsewhere."""
        for rank, wanted in enumerate(placement.node_ids or []):
            if self.node_ids[rank] != wanted:
                raise UserError(
                    f"cluster.devices_per_node: {'+'.join(self.roles)} rank {rank} (device "
                    f"{self.devices[rank % len(self.devices)]}) was pinned to Ray node "
                    f"{wanted[:8]} but runs on {self.node_label(rank)}: this Ray "
                    f"({ray.__version__}) does not honour bundle label selectors; upgrade ray "
                    "(tested with 2.60), or leave devices_per_node out"
                )

    def _local_rank(self, rank: int) -> str:
        if self.device == "cuda":
            # Ray shows each actor only its bundle's GPU (CUDA_VISIBLE_DEVICES): device 0.
            return "0"
        return str(self.devices[rank % len(self.devices)])

    def submit(
        self,
        role: str,
        method: str,
        per_rank_args: list[tuple] | None,
        args: tuple,
        kwargs: dict | None,
    ) -> PendingCall:
        if self._stopped:
            raise WorkerError(
                role, 0, f"worker group is stopped (when sent {method})", "", self.roles
            )
        self.calls += self.world_size
        refs = []
        for rank, actor in enumerate(self.actors):
            call_args = per_rank_args[rank] if per_rank_args is not None else args
            refs.append(actor.handle.remote(role, method, tuple(call_args), kwargs or {}))
        return _RayPending(self, role, method, refs)

    def collect(
        self,
        role: str,
        method: str,
        refs: list,
        timeout_s: float | None = None,
        wrapped: bool = True,
    ) -> list[Any]:
        limit = timeout_s or self.timeout_s
        started = time.monotonic()
        deadline = started + limit
        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        first_error: WorkerError | None = None
        first_lost = False
        call = (id(self), id(refs))
        while pending:
            if self.watch is not None and wrapped:
                self.watch.check(call, role, method, time.monotonic() - started)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                rank = pending.pop(ref)
                error = None
                lost = False
                try:
                    answer = ray.get(ref, timeout=max(1.0, remaining))
                except ActorUnavailableError as exc:
                    # Its process, or its whole node, stopped answering (max_restarts=0: it is
                    # not coming back); Ray marks a node dead only after its health checks fail.
                    what = f"worker actor lost during {method}: its process or its node is gone"
                    error, lost = self._error(role, rank, what, str(exc)), True
                except RayActorError as exc:
                    error = self._error(role, rank, f"worker actor died during {method}", str(exc))
                    lost = True
                except GetTimeoutError:
                    pending[ref] = rank
                    continue
                except Exception as exc:  # e.g. a result that failed to deserialize
                    error = self._error(role, rank, _describe(exc), traceback.format_exc())
                else:
                    if not wrapped:
                        results[rank] = answer
                        continue
                    status, value, trace = answer
                    if status != "ok":
                        error = self._error(role, rank, value, trace)
                        error.user_error = status == "user_error"
                    else:
                        results[rank] = value
                if error is None:
                    continue
                if first_error is None:
                    self._failed = True
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                # A rank whose process (or node) is gone is the cause; a peer's error in the
                # collective they shared (gloo's "connection closed") is its consequence, and
                # often comes first: a loss reported within the grace wins.
                if first_error is None or (lost and not first_lost):
                    first_error, first_lost = error, lost
        if first_error is not None:
            raise first_error
        if pending:
            self._failed = True
            rank = min(pending.values())
            raise self._error(role, rank, f"timed out in {method} after {limit:.0f}s", "")
        if self.watch is not None and wrapped:
            self.watch.finished(role, method, time.monotonic() - started)
        return results

    def stack_targets(self) -> list[StackTarget]:
        return [
            target(f"{'+'.join(self.roles)} rank {rank}", pid, host, stacks_path_for(log))
            for rank, ((pid, host), log) in enumerate(zip(self._pids, self.log_paths))
        ]

    def _error(self, role: str, rank: int, message: str, trace: str) -> WorkerError:
        log = self.log_paths[rank]
        lines = last_words(log)
        detail = trace.rstrip()
        if lines:
            detail += f"\nlast lines of {display_path(log)}:\n{lines.rstrip()}"
        else:
            detail += f"\n(log: {display_path(log)})"
        return WorkerError(
            role, rank, f"{message} (node {self.node_label(rank)})", detail.strip(), self.roles
        )

    def node_label(self, rank: int) -> str:
        """``IP [host, Ray node 1a2b3c4d]``: the IP and host a user knows the node by, and the
        Ray node id that ``ray status`` and Ray's logs use (and that tells apart two nodes of
        one host)."""
        ip, node_id = self.nodes[rank], self.node_ids[rank]
        if node_id == "?":  # it failed before saying where it runs
            return "not known yet"
        host = self._pids[rank][1] if rank < len(self._pids) else "?"
        return f"{ip} [{host}, Ray node {node_id[:8]}]"

    def placement(self) -> str:
        """``on 2 nodes: rank 0 on IP [...]; rank 1 on IP [...]``: where the ranks run."""
        by_node: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            by_node.setdefault(self.node_label(rank), []).append(rank)
        where = "; ".join(f"{_ranks(ranks)} on {label}" for label, ranks in by_node.items())
        return f"on {len(by_node)} node{'s' if len(by_node) != 1 else ''}: {where}"

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.actors and not self._failed:
            refs = [a.stop.remote() for a in self.actors]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []


class RayWorkerGroup(WorkerGroup):
    """One role's view of a :class:`RayProcesses`."""

    @property
    def nodes(self) -> list[str]:
        return self.processes.nodes

    @property
    def actors(self) -> list:
        return self.processes.actors

    def master_address(self) -> str:
        return self.processes.nodes[0]

    def submit(
        self,
        method: str,
        per_rank_args: list[tuple] | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> PendingCall:
        return self.processes.submit(self.role, method, per_rank_args, args, kwargs)

    def shutdown(self) -> None:
        self.processes.shutdown()
