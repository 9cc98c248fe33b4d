"""The ``local`` launcher: each rank is a process on this machine, talking over a pipe.

Ranks are not daemonic processes, because multiprocessing forbids daemons to start processes of
their own and engines do (vLLM's engine core, SGLang's schedulers, DataLoader workers). They
still end with the driver: a group's finalizer stops them when the driver exits, even without a
``shutdown()`` (and before multiprocessing would wait for them); a driver that is killed closes
its pipes, and a rank exits when its pipe closes.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import socket
import time
from typing import Any

from posttrain.errors import WorkerError
from posttrain.launcher.base import GroupSpec, Launcher, PendingCall, WorkerGroup, tail


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LocalPending(PendingCall):
    def __init__(self, group: LocalWorkerGroup, method: str):
        self.group = group
        self.method = method

    def wait(self) -> list[Any]:
        return self.group._collect(self.method)


class LocalWorkerGroup(WorkerGroup):
    def __init__(self, spec: GroupSpec, timeout_s: float, start_timeout_s: float):
        import torch.multiprocessing  # noqa: F401  (tensor sharing over pipes)

        self.role = spec.role
        self.spec = spec
        self.devices = spec.config.device_mapping
        self.world_size = spec.config.num_ranks
        self.timeout_s = timeout_s
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self.conns = []
        self.procs = []
        self.log_paths = []
        # Registered before any rank starts, so a failure while starting them stops the others.
        self._stop = multiprocessing.util.Finalize(
            self, _stop_ranks, args=(self.conns, self.procs), exitpriority=10
        )
        for rank in range(self.world_size):
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.devices[rank % len(self.devices)]),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                **spec.env,
            }
            if spec.threads:
                env["OMP_NUM_THREADS"] = str(spec.threads)
            log_path = os.path.join(spec.run_dir, "logs", f"{spec.role}.rank{rank}.log")
            parent, child = ctx.Pipe()
            from posttrain.launcher.rank_main import serve

            proc = ctx.Process(
                target=serve,
                args=(child, spec, rank, self.world_size, env, log_path),
                name=f"posttrain-{spec.role}-{rank}",
                daemon=False,  # see the module docstring
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.log_paths.append(log_path)
        try:
            self._collect("start", timeout_s=start_timeout_s)
            self.parallel = self.call("setup")
        except BaseException:
            self.shutdown()
            raise

    def submit(self, method, per_rank_args=None, args=(), kwargs=None) -> PendingCall:
        for rank, conn in enumerate(self.conns):
            call_args = per_rank_args[rank] if per_rank_args is not None else args
            try:
                conn.send((method, tuple(call_args), kwargs or {}))
            except (BrokenPipeError, OSError) as exc:
                raise self._dead(rank, f"when sent {method} ({exc})") from None
        return _LocalPending(self, method)

    def _collect(self, method: str, timeout_s: float | None = None) -> list[Any]:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        first_error: WorkerError | None = None
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll(0.05):
                    try:
                        status, value, trace = conn.recv()
                    except (EOFError, OSError):
                        raise self._dead(rank, f"during {method}") from None
                    pending.discard(rank)
                    if status == "error" and first_error is None:
                        first_error = WorkerError(self.role, rank, value, trace)
                        # Peers may now block in a collective: do not wait for them long.
                        deadline = min(deadline, time.monotonic() + 10.0)
                    results[rank] = value
                elif not self.procs[rank].is_alive():
                    raise self._dead(rank, f"during {method}")
            if pending and time.monotonic() > deadline:
                if first_error:
                    raise first_error
                raise WorkerError(
                    self.role,
                    min(pending),
                    f"timed out in {method} after {timeout_s or self.timeout_s:.0f}s",
                    tail(self.log_paths[min(pending)]),
                )
        if first_error:
            raise first_error
        return results

    def _dead(self, rank: int, when: str) -> WorkerError:
        proc = self.procs[rank]
        if proc.exitcode is None:
            proc.join(timeout=2.0)  # a closed pipe: the process is most likely on its way out
        what = "lost" if proc.exitcode is None else f"exited with code {proc.exitcode}"
        return WorkerError(
            self.role, rank, f"worker process {what} {when}", tail(self.log_paths[rank])
        )

    def shutdown(self) -> None:
        self._stop()  # a Finalize runs once: later calls, and the one at exit, do nothing


def _stop_ranks(conns, procs) -> None:
    """Ask every live rank to shut its engine down; kill those that do not exit in time."""
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            try:
                conn.send(("__stop__", (), {}))
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
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.groups: list[LocalWorkerGroup] = []

    def start_group(self, spec: GroupSpec) -> WorkerGroup:
        group = LocalWorkerGroup(spec, self.call_timeout_s, self.start_timeout_s)
        self.groups.append(group)
        return group

    def shutdown(self) -> None:
        for group in reversed(self.groups):
            group.shutdown()
        self.groups.clear()
