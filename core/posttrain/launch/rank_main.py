"""The body of one worker rank: build its context, then serve calls until told to stop.

Shared by every launcher: a local process runs :func:`serve` over a pipe, a Ray actor wraps
:class:`RankServer`.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from posttrain.errors import UserError
from posttrain.host.plugin_host import create_plugin_host
from posttrain.host.references import import_beside
from posttrain.launch.base import GroupSpec
from posttrain.launch.children import end_children
from posttrain.launch.fatal import report_fatal_signals
from posttrain.launch.stacks import install_stack_dump, is_public_call, stacks_path_for
from posttrain.launch.worker import WorkerContext, WorkerRuntime

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from types import TracebackType

START_CALL = -1  # the call id of a rank's start-up answer
# How often a local rank checks that its driver is alive: it exits within about this long of
# the driver's death, whatever it is doing.
DRIVER_POLL_S = 0.5


class RankServer:
    """One rank process, hosting one worker context per role of ``specs`` (several roles on the
    same devices share the process: the hybrid engine)."""

    def __init__(self, specs: list[GroupSpec], rank: int, world_size: int):
        threads = max((s.threads or 0 for s in specs), default=0)
        if threads:
            import torch

            torch.set_num_threads(threads)
        for spec in specs:
            import_beside(spec.base_dir)  # as the driver: modules the workflow names
        host = create_plugin_host()
        plugins = list(dict.fromkeys(p for spec in specs for p in spec.plugins))
        problems = host.load_workflow_plugins(plugins)
        if problems:
            raise RuntimeError("; ".join(p[1] for p in problems))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if any(spec.device == "cuda" for spec in specs):
            import torch

            # The process's current device from the start, whether or not a strategy makes a
            # process group: streams, CUDA graphs and libraries that use the current device
            # must land on this rank's GPU (a graph captured on device 0 while the model ran on
            # device 1 failed the capture of a rollout rank on GPU 1).
            torch.cuda.set_device(local_rank)
            cap = min((s.gpu_memory_gib for s in specs if s.gpu_memory_gib), default=None)
            if cap:
                total = torch.cuda.get_device_properties(local_rank).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2**30 / total))
        self.runtimes: dict[str, WorkerRuntime] = {}
        for spec in specs:
            role = spec.config
            device = f"cuda:{local_rank}" if spec.device == "cuda" else spec.device
            ctx = WorkerContext(
                role=spec.role,
                strategy_name=role.strategy_args.strategy_name,
                config=role.strategy_args.strategy_config,
                model_args=role.model_args,
                training_args=role.training_args,
                generating_args=role.generating_args,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                device=device,
                seed=spec.seed,
                run_dir=spec.run_dir,
                base_dir=spec.base_dir,
                algorithm=spec.algorithm,
                hook=host.hook,
                head=spec.head,
                infer_batch_size=role.infer_batch_size or None,
            )
            self.runtimes[spec.role] = WorkerRuntime(ctx, peers=self.runtimes)

    def handle(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        runtime = self.runtimes[role]
        if method == "run_function":
            # Worker-side code of transports and tools: "module:function"(runtime, *args).
            path, *rest = args
            module, _, name = path.partition(":")
            return getattr(importlib.import_module(module), name)(runtime, *rest, **kwargs)
        return getattr(runtime, method)(*args, **kwargs)

    def shutdown(self) -> None:
        """Shut every hosted role down, the last set up first."""
        for runtime in reversed(list(self.runtimes.values())):
            runtime.shutdown()


def serve(
    conn: Connection,
    specs: list[GroupSpec],
    rank: int,
    world_size: int,
    env: dict[str, str],
    log_path: str,
) -> None:
    """Entry point of a local worker process. Messages are ``(call_id, role, method, args,
    kwargs)``; answers ``(call_id, status, value, traceback)``, in the order of the calls."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as the rank)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    install_stack_dump(stacks_path_for(log_path))  # for the hang watchdog, posttrain stacks
    report_fatal_signals(log)  # a crash's stack, for the driver's report (launch/fatal.py)
    os.environ.clear()  # the driver's environment, not the fork server's (launch/local.py)
    os.environ.update(env)
    release_fork_server()
    exit_with_driver(os.getppid())
    # Ctrl-C in a terminal, and a scheduler's SIGTERM (SLURM, Kubernetes), reach every process
    # of the run: the driver's stops the ranks in order and says how to resume; a rank dying of
    # it first would be reported as a crash. (A rank whose driver is gone exits by itself.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch.multiprocessing  # noqa: F401  (registers tensor sharing for the pipe)

    try:
        server = RankServer(specs, rank, world_size)
    except BaseException as exc:
        traceback.print_exc()
        conn.send((START_CALL, "error", describe_error(exc), traceback.format_exc()))
        return
    conn.send((START_CALL, "ok", None, ""))
    while True:
        try:
            call_id, role, method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "__stop__":
            try:
                server.shutdown()
            finally:
                conn.send((call_id, "ok", None, ""))
            break
        try:
            result = server.handle(role, method, args, kwargs)
        except BaseException as exc:
            traceback.print_exc()
            conn.send((call_id, error_status(exc), describe_error(exc), traceback.format_exc()))
            continue
        conn.send((call_id, "ok", result, ""))


def release_fork_server() -> None:
    """A rank forked by multiprocessing's fork server holds a descriptor that keeps the server
    alive while the rank lives (for ranks that would start processes through it; ours do not).
    Closed, the server ends with the driver, and the ranks with it (exit_with_driver); kept, the
    server and the ranks would wait for each other forever once the driver is killed."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]  # private: not in typeshed


def exit_with_driver(driver_pid: int) -> None:
    """End this rank soon after its driver (``driver_pid``: the rank's parent, the driver or the
    fork server it started, which ends with it), however the driver ended (SIGKILL included) and
    whatever the rank is doing: the pipe's end is read only between two calls, and a rank in a
    collective whose peer is gone, or in a long kernel, would otherwise outlive the run."""

    def watch() -> None:
        while os.getppid() == driver_pid:
            time.sleep(DRIVER_POLL_S)
        print(f"the run's driver is gone (parent pid {driver_pid}): this rank exits", flush=True)
        end_children()  # os._exit skips what would end them
        os._exit(1)

    threading.Thread(target=watch, name="posttrain-driver-watch", daemon=True).start()


def error_status(exc: BaseException) -> str:
    """How a rank's answer names a failure: ``user_error`` for a user's mistake (a
    :class:`UserError`, such as running out of GPU memory), which the driver reports without
    a traceback; ``error`` otherwise."""
    return "user_error" if isinstance(exc, UserError) else "error"


def describe_error(exc: BaseException) -> str:
    """The error a rank reports: its type and message and, when it was raised inside
    torch.distributed (a collective that timed out, a peer that went away), the collective and
    its process group."""
    text = f"{type(exc).__name__}: {exc}"
    collective = _collective(exc.__traceback__)
    return f"{text} (in torch.distributed {collective})" if collective else text


def _collective(tb: TracebackType | None) -> str | None:
    """The collective a traceback raised in: its outermost torch.distributed frame with a public
    name (all_reduce, barrier, an FSDP all-gather's wait; not a decorator's wrapper), with the
    process group it ran on."""
    marker = os.path.join("torch", "distributed", "")
    frames = []
    while tb is not None:
        if marker in tb.tb_frame.f_code.co_filename:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    public = [f for f in frames if is_public_call(f.f_code.co_name)]
    if not frames:
        return None
    frame = (public or frames)[0]
    local = frame.f_locals
    group = next((local[k] for k in ("group", "pg", "process_group") if local.get(k)), None)
    name = getattr(group, "group_name", None) if group is not None else None
    where = f"{frame.f_code.co_name} ({frame.f_code.co_filename.split(marker)[-1]})"
    return f"{where} on group {name}" if name else where
