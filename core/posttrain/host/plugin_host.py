"""Finds, loads and registers plugins; answers which strategies exist and who provides them.

Built-in plugins are registered first; third-party plugins come from the entry-point group
``posttrain``. ``POSTTRAIN_PLUGINS=a,b`` loads only the named entry points;
``POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD=1`` loads none (built-ins stay). Either setting wins over a
workflow's ``plugins:`` list, which is told which setting left its plugin out.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Iterable
from types import ModuleType
from typing import Any, cast

import attrs
import pluggy

from posttrain import hookspecs
from posttrain.errors import PluginError, UserError
from posttrain.host.engine_hooks import (
    ENGINE_FUNCTIONS,
    EngineHooks,
    warn_misnamed_engine_functions,
)
from posttrain.host.engine_source import engine_names
from posttrain.host.references import WHERE_MODULES_ARE
from posttrain.host.strategy import KNOWN_PROVIDERS, StrategySpec

ENTRY_POINT_GROUP = "posttrain"
BUILTIN_PLUGINS = (
    "posttrain.rewards.builtin",
    "posttrain.algorithms.builtin",
    "posttrain.rollout.environments.builtin",
    "posttrain.weight_sync.builtin",
    "posttrain.trainer.plotting",
    "posttrain.trainer.loggers",
    "posttrain.loading.checks",
    "posttrain.algorithms.checks",
    "posttrain.evaluation.checks",
    "posttrain.launch.plan",
)


@attrs.define
class PluginInfo:
    name: str
    source: str  # "builtin", "entry point", "workflow"
    distribution: str = ""
    version: str = ""
    error: str = ""


@attrs.define
class PluginHost:
    pm: pluggy.PluginManager
    plugins: list[PluginInfo] = attrs.field(factory=list)
    # Installed entry points that POSTTRAIN_PLUGINS or POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD left
    # out, by entry-point and distribution name -> (the setting that did, a hint): a workflow
    # naming one is told why it is missing, not that it is not installed.
    excluded: dict[str, tuple[str, str]] = attrs.field(factory=dict)
    _strategies: dict[str, StrategySpec] | None = None

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    @property
    def failures(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    # -- loading ---------------------------------------------------------------------------

    def load_workflow_plugins(self, names: list[str]) -> list[tuple[int, str, str]]:
        """Load the plugins a workflow names. Returns (index, message, hint) for each failure."""
        problems = []
        loaded = {p.name for p in self.plugins if not p.error} | {
            p.distribution for p in self.plugins if not p.error
        }
        for index, name in enumerate(names):
            if name in loaded:
                continue
            failed = next((p for p in self.failures if name in (p.name, p.distribution)), None)
            if failed:
                problems.append(
                    (
                        index,
                        f"plugin '{name}' failed to import: {failed.error}",
                        "fix or reinstall the plugin",
                    )
                )
                continue
            if name in self.excluded:
                # The variable was set on purpose (to debug, or to pick one of two plugins that
                # clash), so the workflow does not override it.
                setting, hint = self.excluded[name]
                problems.append(
                    (index, f"plugin '{name}' is installed but excluded by {setting}", hint)
                )
                continue
            # "module" registers the module's hook functions; "module:attr" a plugin object
            # (an EngineHooks instance), as an entry point would.
            module_name, _, attr = name.partition(":")
            try:
                module = importlib.import_module(module_name)
                plugin = getattr(module, attr) if attr else module
            except ImportError as exc:
                hint = next(
                    (
                        prov
                        for prov in KNOWN_PROVIDERS.values()
                        if prov.split()[0].replace("-", "_") == name.replace("-", "_")
                    ),
                    "",
                )
                problems.append(
                    (
                        index,
                        f"plugin '{name}' is neither installed nor importable ({exc})",
                        f"install {hint}" if hint else WHERE_MODULES_ARE,
                    )
                )
                continue
            except Exception as exc:  # a broken plugin module: reported, the others still load
                problems.append(
                    (
                        index,
                        f"plugin module '{name}' failed to import: {type(exc).__name__}: {exc}",
                        "fix the module",
                    )
                )
                continue
            self._register(plugin, name, PluginInfo(name=name, source="workflow"))
            loaded.add(name)
        return problems

    def _register(self, plugin: object, name: str, info: PluginInfo) -> None:
        self.pm.register(plugin, name=name)
        if isinstance(plugin, EngineHooks):
            warn_misnamed_engine_functions(plugin, name)
        self.plugins.append(info)
        self._strategies = None

    # -- strategies ------------------------------------------------------------------------

    def strategies(self) -> dict[str, StrategySpec]:
        """Every declared strategy by name. Two plugins declaring one name is a PluginError."""
        if self._strategies is None:
            found: dict[str, StrategySpec] = {}
            for impl in self.pm.hook.posttrain_add_strategies.get_hookimpls():
                try:
                    # What the hook specification says it returns (pluggy types it object).
                    declared = cast("list[StrategySpec] | None", impl.function()) or []
                except PluginError as exc:  # a declaration refused as it was made: say whose
                    raise PluginError(f"plugin '{impl.plugin_name}': {exc}") from exc
                for spec in declared:
                    spec = attrs.evolve(spec, plugin=impl.plugin_name)
                    if spec.name in found:
                        raise PluginError(
                            f"strategy '{spec.name}' is provided by two plugins: "
                            f"'{found[spec.name].plugin}' and '{impl.plugin_name}'; uninstall "
                            "one, or pick one with POSTTRAIN_PLUGINS"
                        )
                    found[spec.name] = spec
            self._strategies = found
        return self._strategies

    def fork_preload(self, strategies: Iterable[str] | None = None) -> list[str]:
        """The modules the plugins owning ``strategies`` (default: every plugin) ask the CPU fork
        server to import (``EngineHooks.preload``)."""

        wanted = None if strategies is None else set(strategies)
        modules: list[str] = []
        for plugin in self.pm.get_plugins():
            if isinstance(plugin, EngineHooks) and (
                wanted is None or wanted & set(plugin.strategies)
            ):
                modules += [m for m in plugin.preload if m not in modules]
        return modules

    def answers_by_plugin(self, hook_name: str, **kwargs: Any) -> list[tuple[str, object]]:
        """Call every implementation of a collecting hook; return ``(plugin name, answer)``
        pairs (None answers left out), so that a bad answer can be blamed on its plugin."""
        answers = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            answer = impl.function(**{name: kwargs[name] for name in impl.argnames})
            if answer is not None:
                answers.append((impl.plugin_name, answer))
        return answers

    def hooks_of(self, plugin_name: str) -> list[str]:
        """Every hook the plugin registered an implementation of (as pluggy sees it)."""
        plugin = self.pm.get_plugin(plugin_name)
        if plugin is None:
            return []
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])

    def engine_lacks(self, plugin_name: str) -> list[str] | None:
        """The worker hooks of an :class:`EngineHooks` plugin whose engine function its engine
        module does not define, read from the module's source (the engine is not imported):
        they answer None for every strategy. Empty for any other plugin, and for hooks the
        plugin implements itself; None when the source cannot tell."""
        plugin = self.pm.get_plugin(plugin_name)
        if not isinstance(plugin, EngineHooks):
            return []
        defined = engine_names(plugin.engine)
        if defined is None:
            return None
        return [
            hook
            for hook in self.hooks_of(plugin_name)
            if hook.removeprefix("posttrain_") in ENGINE_FUNCTIONS
            and getattr(type(plugin), hook) is getattr(EngineHooks, hook)  # not overridden
            and hook.removeprefix("posttrain_") not in defined
        ]


def declared_by_name(hook_caller: pluggy.HookCaller, what: str) -> dict[str, Any]:
    """Every plugin's ``{name: declaration}`` from a collecting ``posttrain_add_*`` hook (e.g.
    ``hook.posttrain_add_environments``), merged; a name two plugins declare is an error naming
    both (``what`` says what the names are: "environment", "reward function")."""
    merged: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for impl in hook_caller.get_hookimpls():
        declared = cast("dict[str, Any] | None", impl.function())  # pluggy types it object
        for name, declaration in (declared or {}).items():
            if name in owners:
                raise UserError(
                    f"{what} '{name}' is declared by two plugins: "
                    f"'{owners[name]}' and '{impl.plugin_name}'"
                )
            merged[name], owners[name] = declaration, impl.plugin_name
    return merged


def _load_entry_point_plugins(host: PluginHost) -> None:
    disabled = os.environ.get("POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD", "")
    allowed = os.environ.get("POSTTRAIN_PLUGINS", "")
    allow = {n.strip() for n in allowed.split(",") if n.strip()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else ""
        if disabled not in ("", "0"):
            why = (
                f"POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD={disabled}",
                "unset POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD to load installed plugins",
            )
        elif allow and ep.name not in allow and dist not in allow:
            why = (
                f"POSTTRAIN_PLUGINS={allowed}",
                f"add '{ep.name}' to POSTTRAIN_PLUGINS, or unset it to load every plugin",
            )
        else:
            why = None
        if why:  # remembered, never imported
            host.excluded.update(dict.fromkeys(filter(None, (ep.name, dist)), why))
            continue
        if host.pm.get_plugin(ep.name) is not None:
            continue
        info = PluginInfo(
            name=ep.name,
            source="entry point",
            distribution=dist,
            version=ep.dist.version if ep.dist else "",
        )
        try:
            plugin = ep.load()
        except Exception as exc:  # reported by name; the other plugins keep working
            info.error = f"{type(exc).__name__}: {exc}"
            host.plugins.append(info)
            continue
        host._register(plugin, ep.name, info)


def create_plugin_host(extra_plugins: list[ModuleType | object] | None = None) -> PluginHost:
    """The plugin host for this process: built-ins, then entry points, then ``extra_plugins``."""
    from posttrain.version import __version__

    pm = pluggy.PluginManager("posttrain")
    pm.add_hookspecs(hookspecs)
    host = PluginHost(pm)
    for name in BUILTIN_PLUGINS:
        # "module" registers the module's functions; "module:attr" a plugin object.
        module_name, _, attr = name.partition(":")
        module = importlib.import_module(module_name)
        host._register(
            getattr(module, attr) if attr else module,
            module_name,
            PluginInfo(
                name=module_name, source="builtin", distribution="posttrain", version=__version__
            ),
        )
    _load_entry_point_plugins(host)
    for plugin in extra_plugins or []:
        name = getattr(plugin, "__name__", type(plugin).__name__)
        host._register(plugin, name, PluginInfo(name=name, source="explicit"))
    return host
