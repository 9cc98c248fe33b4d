"""The local launcher tests' helpers: a one-model hf_infer group spec, and rank-side functions
called through ``run_function`` (importable on the ranks: they inherit the driver's sys.path)."""

from __future__ import annotations

import multiprocessing
import os
import sys


def hf_infer_spec(model_path: str, run_dir: str, ranks: int = 1):
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, RoleConfig, StrategyArgs
    from posttrain.launch.base import GroupSpec
    from posttrain_hf_infer.plugin import HFInferConfig

    return GroupSpec(
        role="actor_infer",
        config=RoleConfig(
            strategy_args=StrategyArgs(strategy_name="hf_infer", strategy_config=HFInferConfig()),
            device_mapping=tuple(range(ranks)),
            model_args=ModelArgs(model_name_or_path=model_path),
        ),
        algorithm=AlgorithmConfig(),
        seed=0,
        run_dir=run_dir,
        base_dir=run_dir,
        device="cpu",
        threads=1,
    )


def _exit_with(code: int) -> None:
    sys.exit(code)


def child_exit_code(runtime, code: int) -> int:
    """Start a process from the rank (as engines do) and return its exit code."""
    child = multiprocessing.get_context("spawn").Process(target=_exit_with, args=(code,))
    child.start()
    child.join(timeout=60)
    return child.exitcode


def pid(runtime) -> int:
    return os.getpid()


def payload(runtime, index: int, size: int) -> bytes:
    """``size`` bytes, all ``index``: a large answer takes several reads off the pipe."""
    return bytes([index % 256]) * size


def driver(model_path: str, run_dir: str, mode: str) -> None:
    """A driver process: start two ranks, print their pids, then either wait to be killed
    (``kill``) or return without shutting them down (``exit``)."""
    import time

    from posttrain.launch.local import LocalLauncher

    group = LocalLauncher(start_timeout_s=120).start_group(hf_infer_spec(model_path, run_dir, 2))
    pids = group.call("run_function", "local_rank_helpers:pid")
    print(" ".join(map(str, pids)), flush=True)
    if mode == "kill":
        time.sleep(600)


if __name__ == "__main__":
    driver(*sys.argv[1:])
