"""Worker groups of real engines for the SGLang tests (fsdp2_train trainers, sglang rollouts)."""

from __future__ import annotations

import os

from posttrain.config.converter import CONVERTER
from posttrain.config.sections import (
    AlgorithmConfig,
    GeneratingArgs,
    ModelArgs,
    RoleConfig,
    StrategyArgs,
    TrainingArgs,
)
from posttrain.launcher.base import GroupSpec
from posttrain.plugin_host import create_plugin_host


def group_spec(strategy, raw, ranks, role, model_path, run_dir, generating=None) -> GroupSpec:
    config = CONVERTER.structure(raw, create_plugin_host().strategies()[strategy].config_class)
    return GroupSpec(
        role=role,
        config=RoleConfig(
            strategy_args=StrategyArgs(strategy_name=strategy, strategy_config=config),
            device_mapping=tuple(range(ranks)),
            model_args=ModelArgs(model_name_or_path=model_path),
            training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0),
            generating_args=generating or GeneratingArgs(),
        ),
        algorithm=AlgorithmConfig(),
        seed=1234,
        run_dir=str(run_dir),
        base_dir=str(run_dir),
        device="cpu",
        threads=1,
    )


def descendants(pid: int | None = None) -> set[int]:
    """Process ids below ``pid`` (default: this process), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid or os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def engine_processes(before: set[int]) -> set[int]:
    """Descendants started since ``before`` that are not multiprocessing's resource tracker
    (which the first spawn starts and which lives as long as this process)."""
    out = set()
    for pid in descendants() - before:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except OSError:
            continue  # gone meanwhile
        out.add(pid)
    return out
