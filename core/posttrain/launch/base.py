"""The interface every launcher implements."""

from __future__ import annotations

import abc
import os
from typing import Any

import attrs

from posttrain.config.sections import RoleConfig


@attrs.frozen(kw_only=True)
class GroupSpec:
    """Everything a rank needs to build its :class:`posttrain.launch.worker.WorkerContext`."""

    role: str
    config: RoleConfig
    algorithm: Any
    seed: int
    run_dir: str
    base_dir: str
    device: str  # "cpu" or "cuda"
    plugins: tuple[str, ...] = ()  # workflow-named plugins to load on the rank too
    threads: int | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    head: str = "lm"  # the model head the role loads (WorkerContext.head)
    gpu_memory_gib: float | None = None  # cluster.gpu_memory_gib: the rank's allocator's cap


class PendingCall(abc.ABC):
    @abc.abstractmethod
    def wait(self) -> list[Any]:
        """Block until every rank answered; return the answers in rank order."""


class WorkerGroup(abc.ABC):
    """The ranks of one role. Several roles' groups may share one set of rank processes (the
    hybrid engine): ``processes`` is that set, the same object for every group in it."""

    def __init__(self, processes: Any, spec: GroupSpec):
        self.role = spec.role
        self.spec = spec
        self.processes = processes
        self.devices: tuple[int, ...] = spec.config.device_mapping
        self.world_size: int = processes.world_size
        self.parallel: list[dict[str, int]] = []

    @property
    def log_paths(self) -> list[str]:
        return self.processes.log_paths

    def shares_processes_with(self, other: WorkerGroup) -> bool:
        return self.processes is other.processes

    def shares_devices_with(self, other: WorkerGroup) -> bool:
        """Colocated: the two groups have a device in common."""
        return bool(set(self.devices) & set(other.devices))

    @property
    def dp_size(self) -> int:
        return self.parallel[0].get("dp_size", self.world_size) if self.parallel else 1

    def dp_ranks(self) -> list[int]:
        """For each data-parallel index, the first rank holding it (the rank to collect from)."""
        first: dict[int, int] = {}
        for rank, info in enumerate(self.parallel):
            first.setdefault(info.get("dp_rank", rank), rank)
        return [first[i] for i in sorted(first)]

    @abc.abstractmethod
    def submit(
        self,
        method: str,
        per_rank_args: list[tuple] | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> PendingCall:
        """Start ``method`` on every rank: with ``per_rank_args[r]`` or the same ``args``."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """One-to-all: the same arguments to every rank; every rank's answer."""
        return self.submit(method, args=args, kwargs=kwargs).wait()

    def call_dp(self, method: str, shares: list[Any], *extra: Any) -> list[Any]:
        """Split by data-parallel rank: rank r gets ``shares[dp_rank(r)]``; answers of each DP
        index's first rank, in DP order."""
        per_rank = [
            (shares[info.get("dp_rank", r)], *extra) for r, info in enumerate(self.parallel)
        ]
        answers = self.submit(method, per_rank_args=per_rank).wait()
        return [answers[r] for r in self.dp_ranks()]

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""

    def master_address(self) -> str:
        """The address of rank 0's host, for rendezvous with other groups (weight sync)."""
        return "127.0.0.1"


class Launcher(abc.ABC):
    """Starts sets of rank processes and stops them. A subclass makes one set
    (:meth:`_make_processes`: the processes, started, and a group per role); the rest is
    shared: the roles' set-up in order, the count of driver calls, the shutdown."""

    def __init__(self, call_timeout_s: float, start_timeout_s: float):
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.process_sets: list[Any] = []
        self._calls_of_stopped = 0
        # The driver's HangWatch (posttrain.launch.hang_watch), handed to each set of processes.
        self.hang_watch: Any = None

    @abc.abstractmethod
    def _make_processes(self, specs: list[GroupSpec]) -> tuple[Any, dict[str, WorkerGroup]]:
        """Start the rank processes of ``specs`` (they expose ``calls``, ``watch``,
        ``stack_targets()`` and ``shutdown()``) and return them with a worker group per role."""

    def start_processes(self, specs: list[GroupSpec]) -> dict[str, WorkerGroup]:
        """Start one set of rank processes hosting every role of ``specs`` (all with the same
        device mapping), run each role's setup in order (parallel groups, model loading) and
        return each role's group."""
        processes, groups = self._make_processes(specs)
        processes.watch = self.hang_watch
        self.process_sets.append(processes)
        try:
            for group in groups.values():  # in order: the first role makes the process group
                group.parallel = group.call("setup")
        except BaseException:
            processes.shutdown()
            raise
        return groups

    def description(self) -> str:
        """One line on where the rank processes run, printed when the run starts ("" for
        this machine's own processes, which need no saying)."""
        return ""

    def placement_of_last(self) -> str:
        """Where the ranks of the set of rank processes started last run, for the console
        ("" for this machine's own processes)."""
        return ""

    def start_group(self, spec: GroupSpec) -> WorkerGroup:
        """Start the ranks of one role in processes of their own."""
        return self.start_processes([spec])[spec.role]

    def stack_targets(self) -> list[Any]:
        """Every rank process this launcher started, as :class:`~posttrain.launch.stacks.
        StackTarget` (whose stacks the hang watchdog and ``posttrain stacks`` ask for)."""
        return [t for processes in self.process_sets for t in processes.stack_targets()]

    def driver_calls(self) -> int:
        """How many calls the driver has sent to rank processes so far (one per rank)."""
        return self._calls_of_stopped + sum(p.calls for p in self.process_sets)

    def shutdown(self) -> None:
        """Stop every set of rank processes this launcher started, the last one first."""
        for processes in reversed(self.process_sets):
            processes.shutdown()
            self._calls_of_stopped += processes.calls
        self.process_sets.clear()


def rank_log_path(run_dir: str, roles: list[str] | tuple[str, ...], rank: int) -> str:
    """A rank's log: named after every role its process hosts."""
    return os.path.join(run_dir, "logs", f"{'+'.join(roles)}.rank{rank}.log")


def check_same_mapping(specs: list[GroupSpec]) -> None:
    """Roles hosted by one set of processes are placed rank for rank on the same devices."""
    first = specs[0].config
    for spec in specs[1:]:
        if (spec.config.device_mapping, spec.config.num_ranks) != (
            first.device_mapping,
            first.num_ranks,
        ):
            raise ValueError(
                f"roles {specs[0].role} and {spec.role} cannot share rank processes: their "
                "device mappings or rank counts differ"
            )


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def partial_overlaps(roles: dict[str, RoleConfig]) -> list[tuple[str, str, str]]:
    """``(role_a, role_b, message)`` for each two roles whose device mappings overlap without
    one holding the other (the ray launcher colocates equal mappings and subsets only)."""
    found = []
    names = list(roles)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            da, db = set(roles[a].device_mapping), set(roles[b].device_mapping)
            if da & db and not (da <= db or db <= da):
                found.append(
                    (
                        a,
                        b,
                        f"{a}.device_mapping {sorted(da)} and {b}.device_mapping {sorted(db)} "
                        "overlap only in part; the ray launcher colocates roles on the same "
                        "devices, or on a subset of another role's devices",
                    )
                )
    return found
