"""The body of one worker rank: build its context, then serve calls until told to stop.

Shared by every launcher: a local process runs :func:`serve` over a pipe, a Ray actor wraps
:class:`RankServer`.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

from posttrain.launcher.base import GroupSpec


class RankServer:
    def __init__(self, spec: GroupSpec, rank: int, world_size: int):
        from posttrain.plugin_host import create_plugin_host
        from posttrain.worker import WorkerContext, WorkerRuntime

        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        host = create_plugin_host()
        problems = host.load_workflow_plugins(list(spec.plugins))
        if problems:
            raise RuntimeError("; ".join(p[1] for p in problems))
        role = spec.config
        device = spec.device
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        ctx = WorkerContext(
            role=spec.role,
            strategy_name=role.strategy_args.strategy_name,
            config=role.strategy_args.strategy_config,
            model_args=role.model_args,
            training_args=role.training_args,
            generating_args=role.generating_args,
            rank=rank,
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            device=device,
            seed=spec.seed,
            run_dir=spec.run_dir,
            base_dir=spec.base_dir,
            algorithm=spec.algorithm,
            hook=host.hook,
        )
        if role.infer_batch_size:
            ctx.state["infer_batch_size"] = role.infer_batch_size
        self.runtime = WorkerRuntime(ctx)

    def handle(self, method: str, args: tuple, kwargs: dict) -> Any:
        if method == "run_function":
            # Worker-side code of transports and tools: "module:function"(runtime, *args).
            path, *rest = args
            module, _, name = path.partition(":")
            return getattr(importlib.import_module(module), name)(self.runtime, *rest, **kwargs)
        return getattr(self.runtime, method)(*args, **kwargs)


def serve(
    conn, spec: GroupSpec, rank: int, world_size: int, env: dict[str, str], log_path: str
) -> None:
    """Entry point of a local worker process."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as the rank)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(env)
    import torch.multiprocessing  # noqa: F401  (registers tensor sharing for the pipe)

    try:
        server = RankServer(spec, rank, world_size)
    except BaseException as exc:
        traceback.print_exc()
        conn.send(("error", _describe(exc), traceback.format_exc()))
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        method, args, kwargs = message
        if method == "__stop__":
            try:
                server.handle("shutdown", (), {})
            finally:
                conn.send(("ok", None, ""))
            break
        try:
            result = server.handle(method, args, kwargs)
        except BaseException as exc:
            traceback.print_exc()
            conn.send(("error", _describe(exc), traceback.format_exc()))
            continue
        conn.send(("ok", result, ""))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
