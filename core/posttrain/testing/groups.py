"""Worker groups and engine processes for backend tests that drive real engines by hand.

:func:`group_spec` builds the :class:`GroupSpec` a :class:`LocalLauncher` starts (one role on CPU
ranks, strategy_config structured by the strategy's own class); :func:`engine_processes` lists the
processes started under the test since a :func:`descendants` snapshot, so a test can assert that
an engine's shutdown left nothing behind.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from posttrain.config.converter import CONVERTER
from posttrain.config.sections import (
    AlgorithmConfig,
    GeneratingArgs,
    ModelArgs,
    RoleConfig,
    StrategyArgs,
    TrainingArgs,
)
from posttrain.host.plugin_host import create_plugin_host
from posttrain.launch.base import GroupSpec

if TYPE_CHECKING:
    import pathlib

    import pluggy

# multiprocessing's helpers: started by the first spawn, they live as long as the test process.
_HELPERS = (b"resource_tracker", b"forkserver")


def group_spec(
    strategy: str,
    raw: dict[str, Any],
    ranks: int,
    role: str,
    model_path: str,
    run_dir: str | pathlib.Path,
    *,
    base_dir: str | pathlib.Path | None = None,
    generating: GeneratingArgs | None = None,
    env: dict[str, str] | None = None,
    head: str = "lm",
) -> GroupSpec:
    """``role`` on CPU ranks ``0 .. ranks-1`` running ``strategy`` with config ``raw``, loading
    the model with ``head`` (``WorkerContext.head``)."""
    config: Any = CONVERTER.structure(raw, create_plugin_host().strategies()[strategy].config_class)
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
        base_dir=str(base_dir if base_dir is not None else run_dir),
        device="cpu",
        threads=1,
        env=env or {},
        head=head,
    )


def engine_hook_relay(plugin: object, name: str) -> pluggy.HookRelay:
    """A hook relay with only ``plugin`` and the core's algorithm pieces registered: for tests
    that drive one strategy's engine by hand through :class:`posttrain.WorkerRuntime`
    (its train step looks the policy loss up through the hooks)."""
    import pluggy

    from posttrain import hookspecs
    from posttrain.algorithms import builtin as algorithms

    pm = pluggy.PluginManager("posttrain")
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name=name)
    pm.register(algorithms, name="algorithms")
    return pm.hook


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
            continue  # gone meanwhile, or not a process entry
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid or os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def engine_processes(before: set[int]) -> set[int]:
    """Descendants started since the ``before`` snapshot, multiprocessing's helpers left out."""
    out = set()
    for pid in descendants() - before:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue  # gone meanwhile
        if not any(helper in cmd for helper in _HELPERS):
            out.add(pid)
    return out
