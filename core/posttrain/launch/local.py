"""The ``local`` launcher: each rank is a process on this machine, talking over a pipe.

Ranks are not daemonic processes, because multiprocessing forbids daemons to start processes of
their own and engines do (vLLM's engine core, SGLang's schedulers, DataLoader workers). They
still end with the driver: a group's finalizer stops them when the driver exits, even without a
``shutdown()`` (and before multiprocessing would wait for them); a driver that is killed closes
its pipes, and a rank exits when its pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from posttrain.errors import WorkerError
from posttrain.launch.base import (
    GroupSpec,
    Launcher,
    PendingCall,
    WorkerGroup,
    check_same_mapping,
    rank_log_path,
    tail,
)
from posttrain.launch.fatal import last_words, signal_name
from posttrain.launch.rank_main import START_CALL, serve
from posttrain.launch.stacks import StackTarget, stacks_path_for, target, this_node

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess
    from types import TracebackType

STOP_CALL = -2
LOG = logging.getLogger(__name__)


# What every rank imports before anything else: a fork server imports it once, and ranks start as
# its forks instead of importing it each (seconds of CPU per rank: most of a small job's start).
PRELOADED = ("torch", "transformers", "posttrain.launch.rank_main")
# Engines' libraries the fork server imports too (``EngineHooks.preload``: megatron-core alone
# takes 10 s a rank on a CI core), named before the server starts: it reads the list once.
_engine_preload: list[str] = []


def preload_in_fork_server(modules: Iterable[str]) -> None:
    """Have the CPU fork server import ``modules`` too, once it starts (a server already running
    keeps what it has; a rank imports the rest itself). A module that fails to import there is
    left to the ranks, which report the error."""
    for module in modules:
        if module not in _engine_preload:
            _engine_preload.append(module)


def rank_context(device: str) -> SpawnContext | ForkServerContext:
    """Where rank processes come from: on CPUs, forks of a server process that has imported the
    heavy modules and nothing else (no thread, no engine), one per driver process and reused by
    every group it starts. GPU ranks are spawned: a library that asks the CUDA driver anything
    while being imported would leave every fork unable to use the GPU, and a GPU job's start is
    not its imports. Spawned too where fork servers do not exist."""
    if device != "cpu" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOADED, *_engine_preload])
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LocalPending(PendingCall):
    def __init__(self, processes: LocalProcesses, call_id: int, role: str, method: str):
        self.processes = processes
        self.call_id = call_id
        self.role = role
        self.method = method

    def wait(self) -> list[Any]:
        return self.processes.collect(self.call_id, self.role, self.method)


class LocalProcesses:
    """One set of rank processes on this machine hosting the roles of ``specs``, one pipe each.

    Every call carries an id; answers are matched to calls by it, so calls to several roles of
    the same processes may be in flight at once (each rank answers them in order), from several
    driver threads too (the asynchronous rollout's producer and the loop): a lock keeps one
    thread at a time on the pipes, whose messages two readers would tear apart."""

    def __init__(self, specs: list[GroupSpec], timeout_s: float, start_timeout_s: float):
        import torch.multiprocessing  # noqa: F401  (tensor sharing over pipes)

        _quiet_handover_errors()

        check_same_mapping(specs)
        self.roles = tuple(spec.role for spec in specs)
        first = specs[0]
        devices = first.config.device_mapping
        self.world_size = first.config.num_ranks
        self.timeout_s = timeout_s
        self.watch = None  # the driver's HangWatch, once the launcher hands it over
        self.calls = 0
        self._next_id = 0
        self._answers: list[dict[int, tuple]] = [{} for _ in range(self.world_size)]
        self._pipes = threading.Lock()
        ctx = rank_context(first.device)
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        self.log_paths: list[str] = []
        # Registered before any rank starts, so a failure while starting them stops the others.
        self._stop = multiprocessing.util.Finalize(
            self, _stop_ranks, args=(self.conns, self.procs), exitpriority=10
        )
        env_extra = {k: v for spec in specs for k, v in spec.env.items()}
        threads = max((spec.threads or 0 for spec in specs), default=0)
        for rank in range(self.world_size):
            env = {
                # The driver's environment as it is now (a fork server keeps the one it started
                # with), then the rank's own.
                **os.environ,
                # (a rank's parent is the fork server: the driver is named here)
                "POSTTRAIN_DRIVER_PID": str(os.getpid()),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(devices[rank % len(devices)]),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                **env_extra,
            }
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            log_path = rank_log_path(first.run_dir, self.roles, rank)
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(child, specs, rank, self.world_size, env, log_path),
                name=f"posttrain-{'+'.join(self.roles)}-{rank}",
                daemon=False,  # see the module docstring
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.log_paths.append(log_path)
        try:
            self.collect(START_CALL, self.roles[0], "start", timeout_s=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def send(
        self,
        role: str,
        method: str,
        per_rank_args: list[tuple] | None,
        args: tuple,
        kwargs: dict | None,
    ) -> int:
        with self._pipes:
            call_id = self._next_id
            self._next_id += 1
            self.calls += self.world_size
            for rank, conn in enumerate(self.conns):
                call_args = per_rank_args[rank] if per_rank_args is not None else args
                try:
                    conn.send((call_id, role, method, tuple(call_args), kwargs or {}))
                except (BrokenPipeError, OSError) as exc:
                    raise self._dead(role, rank, f"when sent {method} ({exc})") from None
        return call_id

    def collect(
        self, call_id: int, role: str, method: str, timeout_s: float | None = None
    ) -> list[Any]:
        limit = timeout_s or self.timeout_s
        started = time.monotonic()
        deadline = started + limit
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        first_error: WorkerError | None = None
        while pending:
            if self.watch is not None:
                self.watch.check((id(self), call_id), role, method, time.monotonic() - started)
            for rank in sorted(pending):
                answer = self._answer(rank, call_id, role, method)
                if answer is not None:
                    status, value, trace = answer
                    pending.discard(rank)
                    if status != "ok" and first_error is None:
                        first_error = WorkerError(
                            role, rank, value, trace, self.roles, status == "user_error"
                        )
                        # Peers may now block in a collective: do not wait for them long.
                        deadline = min(deadline, time.monotonic() + 10.0)
                    results[rank] = value
                elif not self.procs[rank].is_alive():
                    raise self._dead(role, rank, f"during {method}")
            if pending and time.monotonic() > deadline:
                if first_error:
                    raise first_error
                rank = min(pending)
                raise WorkerError(
                    role,
                    rank,
                    f"timed out in {method} after {limit:.0f}s",
                    tail(self.log_paths[rank]),
                    self.roles,
                )
        if first_error:
            raise first_error
        if self.watch is not None:
            self.watch.finished(role, method, time.monotonic() - started)
        return results

    def stack_targets(self) -> list[StackTarget]:
        node = this_node()
        targets = []
        for rank, (proc, log) in enumerate(zip(self.procs, self.log_paths)):
            assert proc.pid is not None  # listed once started
            label = f"{'+'.join(self.roles)} rank {rank}"
            targets.append(target(label, proc.pid, node, stacks_path_for(log)))
        return targets

    def _answer(self, rank: int, call_id: int, role: str, method: str) -> tuple | None:
        """Rank ``rank``'s answer to ``call_id`` if it has come (answers to other calls that
        arrive first are kept for their own ``collect``)."""
        with self._pipes:
            return self._receive(rank, call_id, role, method)

    def _receive(self, rank: int, call_id: int, role: str, method: str) -> tuple | None:
        kept = self._answers[rank]
        if call_id in kept:
            return kept.pop(call_id)
        conn = self.conns[rank]
        while conn.poll(0.05 if not kept else 0):
            try:
                got, status, value, trace = conn.recv()
            except (EOFError, OSError):
                raise self._dead(role, rank, f"during {method}") from None
            if got == call_id:
                return status, value, trace
            kept[got] = (status, value, trace)
        return None

    def _dead(self, role: str, rank: int, when: str) -> WorkerError:
        proc = self.procs[rank]
        if proc.exitcode is None:
            proc.join(timeout=2.0)  # a closed pipe: the process is most likely on its way out
        died_of = signal_name(proc.exitcode)
        if proc.exitcode is None:
            what = "lost"
        elif died_of:
            what = f"died of {died_of}"
        else:
            what = f"exited with code {proc.exitcode}"
        return WorkerError(
            role,
            rank,
            f"worker process {what} {when}",
            last_words(self.log_paths[rank]),
            self.roles,
        )

    def shutdown(self) -> None:
        self._stop()  # a Finalize runs once: later calls, and the one at exit, do nothing


class LocalWorkerGroup(WorkerGroup):
    """One role's view of a :class:`LocalProcesses`."""

    @property
    def procs(self) -> list[BaseProcess]:
        return self.processes.procs

    def submit(
        self,
        method: str,
        per_rank_args: list[tuple] | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> PendingCall:
        call_id = self.processes.send(self.role, method, per_rank_args, args, kwargs)
        return _LocalPending(self.processes, call_id, self.role, method)

    def shutdown(self) -> None:
        self.processes.shutdown()


_SHARER = os.path.join("multiprocessing", "resource_sharer.py")
_quieted: list[object] = []  # the hook, once installed in this process


def _quiet_handover_errors() -> None:
    """Keep a dead rank's half-done tensor handover off the console.

    A CPU tensor sent over a pipe travels as a file descriptor that the receiving rank fetches
    from multiprocessing's resource sharer, a thread of the driver that reports its errors
    through ``sys.excepthook``. A rank killed in the middle of a fetch then printed a
    ConnectionResetError's traceback above the run's own error, which names the rank and its
    signal. Those errors go to the debug log; every other exception reaches the hook as before.
    """
    if _quieted:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, ConnectionError | EOFError) and _through(tb, _SHARER):
            LOG.debug("a rank went away while fetching a shared tensor: %r", value)
            return
        previous(kind, value, tb)

    sys.excepthook = hook
    _quieted.append(hook)


def _through(tb: TracebackType | None, filename: str) -> bool:
    """Whether a frame of the traceback ``tb`` runs code of ``filename``."""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(filename):
            return True
        tb = tb.tb_next
    return False


def _stop_ranks(conns: list[Connection], procs: list[BaseProcess]) -> None:
    """Ask every live rank to shut its engine down; kill those that do not exit in time."""
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            try:
                conn.send((STOP_CALL, "", "__stop__", (), {}))
            except (BrokenPipeError, OSError):
                continue
    deadline = time.monotonic() + 15
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


class LocalLauncher(Launcher):
    def __init__(self, call_timeout_s: float = 1800.0, start_timeout_s: float = 300.0):
        super().__init__(call_timeout_s, start_timeout_s)

    def _make_processes(self, specs: list[GroupSpec]) -> tuple[Any, dict[str, WorkerGroup]]:
        processes = LocalProcesses(specs, self.call_timeout_s, self.start_timeout_s)
        return processes, {spec.role: LocalWorkerGroup(processes, spec) for spec in specs}
