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
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.errors import WorkerError
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
        self.server = None

    def node_info(self) -> tuple[str, int, int, str]:
        """This actor's node IP, a port free on that node (for the group's rendezvous), its pid
        and its host's name (for its stacks)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1], os.getpid(), this_node()

    def start(self, specs: list[GroupSpec], rank: int, world_size: int, env: dict[str, str]):
        os.environ.update(env)
        try:
            self.server = RankServer(specs, rank, world_size)
        except BaseException as exc:
            traceback.print_exc()
            return ("error", describe_error(exc), traceback.format_exc())
        return ("ok", None, "")

    def stop(self):
        return self.handle("", "__stop__", (), {})

    def handle(self, role: str, method: str, args: tuple, kwargs: dict):
        try:
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


class _RayPending(PendingCall):
    def __init__(self, processes: RayProcesses, role: str, method: str, refs: list):
        self.processes = processes
        self.role = role
        self.method = method
        self.refs = refs

    def wait(self) -> list[Any]:
        return self.processes.collect(self.role, self.method, self.refs)


class Placement:
    """Where each rank of a role goes: a placement group and a bundle index per rank."""

    def __init__(self, pg, bundles: list[int], cpus: list[float], gpus: list[float]):
        self.pg = pg
        self.bundles = bundles
        self.cpus = cpus
        self.gpus = gpus


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
        self.nodes = ["?"] * self.world_size
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
            master_addr, master_port = infos[0][:2]
            refs = []
            for rank, actor in enumerate(self.actors):
                env = {
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(self.world_size),
                    "LOCAL_RANK": self._local_rank(rank),
                    "LOCAL_WORLD_SIZE": str(self.nodes.count(self.nodes[rank])),
                    **env_extra,
                }
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)
                refs.append(actor.start.remote(specs, rank, self.world_size, env))
            self.collect(self.roles[0], "start", refs, timeout_s=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _local_rank(self, rank: int) -> str:
        if self.device == "cuda":
            # Ray shows each actor only its bundle's GPU (CUDA_VISIBLE_DEVICES): device 0.
            return "0"
        return str(self.devices[rank % len(self.devices)])

    def submit(self, role: str, method, per_rank_args, args, kwargs) -> PendingCall:
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
                try:
                    answer = ray.get(ref, timeout=max(1.0, remaining))
                except RayActorError as exc:
                    error = self._error(role, rank, f"worker actor died during {method}", str(exc))
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
                if error is not None and first_error is None:
                    first_error = error
                    self._failed = True
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
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
            role, rank, f"{message} (node {self.nodes[rank]})", detail.strip(), self.roles
        )

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

    def submit(self, method, per_rank_args=None, args=(), kwargs=None) -> PendingCall:
        return self.processes.submit(self.role, method, per_rank_args, args, kwargs)

    def shutdown(self) -> None:
        self.processes.shutdown()
