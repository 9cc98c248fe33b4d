"""Checks of the ``environment`` section against the declared environments (before anything
starts), and what they settle: the environment's typed config and its stop strings."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.converter import structure_into
from posttrain.config.report import ErrorReport, did_you_mean
from posttrain.config.sections import GeneratingArgs, Workflow
from posttrain.errors import UserError
from posttrain.host.references import WHERE_MODULES_ARE, missing_module, split_reference
from posttrain.rollout.environments.registry import environment_specs

if TYPE_CHECKING:
    import pluggy

    from posttrain.host.strategy import StrategySpec
    from posttrain.rollout.environments.protocol import EnvironmentSpec


def check_environment(
    wf: Workflow,
    raw: Any,
    hook: pluggy.HookRelay,
    strategies: dict[str, StrategySpec],
    report: ErrorReport,
) -> Workflow:
    """Report what is wrong with ``environment``; return the workflow with
    ``environment.kwargs`` structured into the environment's config class and its stop strings
    added to ``actor_infer.generating_args.stop_strings`` (engines that set stop strings up when
    they start read them there). ``raw`` is the section as the YAML holds it: when the section
    failed to structure, its name and kwargs are still checked from there (every error at
    once)."""
    structured = "environment" not in report.failed_sections
    section = raw if isinstance(raw, dict) else {}
    name = wf.environment.name if structured else section.get("name")
    kwargs = wf.environment.kwargs if structured else section.get("kwargs")
    if not isinstance(name, str):
        if structured and kwargs:
            report.error(
                "environment.kwargs",
                "set, but there is no environment.name",
                "name an environment, or remove the kwargs",
            )
        return wf
    try:
        specs = environment_specs(hook)
    except UserError as exc:  # two plugins declare one name
        report.error("plugins", str(exc))
        return wf
    spec = specs.get(name)
    if spec is None:
        close = did_you_mean(name, specs)
        hint = f"{close} " if close.startswith("did you mean") else ""
        report.error(
            "environment.name",
            f"unknown environment '{name}'",
            f"{hint}available: {', '.join(sorted(specs)) or 'none'}",
        )
        return wf
    _check_factory(name, spec, report)
    kwargs = kwargs if kwargs is not None else {}
    if spec.config_class is not None:
        config = structure_into(kwargs, spec.config_class, "environment.kwargs", report)
    elif isinstance(kwargs, dict):
        config = kwargs
    else:
        report.error("environment.kwargs", f"expected a mapping, got {type(kwargs).__name__}")
        config = None
    if config is None or not structured:
        return wf
    if wf.environment.isolation == "process":
        _check_sendable(name, spec, config, report)
    wf = attrs.evolve(wf, environment=attrs.evolve(wf.environment, kwargs=config))
    return _with_stop_strings(wf, spec.stops(config), strategies, report)


def _check_factory(name: str, spec: EnvironmentSpec, report: ErrorReport) -> None:
    """A factory given as ``"module:attr"`` must name a module that can be found (it is
    imported when the first episode starts)."""
    if callable(spec.factory):
        return
    reference = split_reference(spec.factory)
    if reference is None:
        report.error(
            "environment.name",
            f"environment '{name}' names factory '{spec.factory}', not of the form 'module:attr'",
            "fix the plugin that declares it (posttrain_add_environments)",
        )
        return
    problem = missing_module(reference[0])
    if problem:
        report.error(
            "environment.name",
            f"environment '{name}' has factory '{spec.factory}', whose {problem}",
            WHERE_MODULES_ARE,
        )


def _check_sendable(name: str, spec: EnvironmentSpec, config: Any, report: ErrorReport) -> None:
    """``isolation: process`` pickles the factory and the kwargs to each worker process."""
    try:
        pickle.dumps((spec.factory, config))
    except Exception as exc:
        report.error(
            "environment.isolation",
            f"process: environment '{name}' cannot be sent to a worker process ({exc})",
            "its plugin must declare the factory as a module-level class or function (or "
            "'module:attr'); or use isolation: thread",
        )


def _with_stop_strings(
    wf: Workflow,
    stops: tuple[str, ...],
    strategies: dict[str, StrategySpec],
    report: ErrorReport,
) -> Workflow:
    infer = wf.actor_infer
    if not stops or infer is None:
        return wf
    rollout = strategies.get(infer.strategy_args.strategy_name)
    if rollout is not None and not rollout.capabilities.stop_strings:
        report.error(
            "environment.name",
            f"'{wf.environment.name}' ends turns with stop strings ({', '.join(stops)}), "
            f"which '{rollout.name}' does not support",
            "use a rollout strategy that supports stop strings",
        )
        return wf
    gen = infer.generating_args or GeneratingArgs()
    merged = [*gen.stop_strings, *(s for s in stops if s not in gen.stop_strings)]
    gen = attrs.evolve(gen, stop_strings=merged)
    return attrs.evolve(wf, actor_infer=attrs.evolve(infer, generating_args=gen))
