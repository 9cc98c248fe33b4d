"""The metric loggers plugins declare (``posttrain_add_loggers``), by name: the checks of
``trainer.logger`` and ``trainer.logger_args`` before anything starts, and the loggers of a run
(each built by its :class:`~posttrain.trainer.logger_spec.LoggerSpec`'s factory)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.config.converter import structure_into
from posttrain.config.report import ErrorReport, join_path, unknown_name_hint
from posttrain.config.sections import Workflow
from posttrain.errors import UserError
from posttrain.host.plugin_host import declared_by_name
from posttrain.host.references import (
    WHERE_MODULES_ARE,
    load_reference,
    missing_module,
    split_reference,
)
from posttrain.trainer.logger_spec import LoggerContext, LoggerSpec

if TYPE_CHECKING:
    import pluggy
    from rich.console import Console

# Loggers the project's own packages provide, to say what to install when one is missing.
KNOWN_PROVIDERS = {
    "wandb": "posttrain-trackers, with its wandb extra",
    "mlflow": "posttrain-trackers, with its mlflow extra",
}


def logger_specs(hook: pluggy.HookRelay) -> dict[str, LoggerSpec]:
    """Every declared logger; one name declared by two plugins is an error naming both."""
    return declared_by_name(hook.posttrain_add_loggers, "logger")


def check_loggers(wf: Workflow, hook: pluggy.HookRelay, report: ErrorReport) -> Workflow:
    """Report unknown names in ``trainer.logger``, ``trainer.logger_args`` entries for loggers
    the run does not use, and bad options; return the workflow with each entry structured into
    its logger's config class."""
    if "trainer" in report.failed_sections:
        return wf
    try:
        specs = logger_specs(hook)
    except UserError as exc:  # two plugins declare one name
        report.error("plugins", str(exc))
        return wf
    names = wf.trainer.logger
    for index, name in enumerate(names):
        spec = specs.get(name)
        if spec is None:
            hint = unknown_name_hint(name, specs, "loggers", KNOWN_PROVIDERS)
            report.error(join_path("trainer", "logger", index), f"unknown logger '{name}'", hint)
        else:
            _check_factory(name, spec, join_path("trainer", "logger", index), report)
        if name in names[:index]:
            report.error(join_path("trainer", "logger", index), f"logger '{name}' is named twice")
    for name in wf.trainer.logger_args:
        if name not in names:
            report.error(
                join_path("trainer", "logger_args", name),
                f"options for logger '{name}', which trainer.logger does not name",
                f"add '{name}' to trainer.logger, or remove its options",
            )
    # Every named logger with a config class gets its options structured (its defaults when
    # the workflow sets none), so the run's record shows what each logger ran with.
    structured = {}
    for name in dict.fromkeys(names):
        spec = specs.get(name)
        options = wf.trainer.logger_args.get(name)
        if spec is None or (options is None and spec.config_class is None):
            continue
        path = join_path("trainer", "logger_args", name)
        if spec.config_class is not None:
            options = structure_into(options or {}, spec.config_class, path, report)
        elif not isinstance(options, dict):
            report.error(path, f"expected a mapping, got {type(options).__name__}")
            options = None
        structured[name] = options
    trainer = attrs.evolve(wf.trainer, logger_args={**wf.trainer.logger_args, **structured})
    return attrs.evolve(wf, trainer=trainer)


def _check_factory(name: str, spec: LoggerSpec, path: str, report: ErrorReport) -> None:
    """A ``"module:attr"`` factory must name a module that can be found (imported when the
    run starts)."""
    if callable(spec.factory):
        return
    reference = split_reference(spec.factory)
    if reference is None:
        report.error(
            path,
            f"logger '{name}' names factory '{spec.factory}', not of the form 'module:attr'",
            "fix the plugin that declares it (posttrain_add_loggers)",
        )
        return
    problem = missing_module(reference[0])
    if problem:
        report.error(
            path,
            f"logger '{name}' has factory '{spec.factory}', whose {problem}",
            WHERE_MODULES_ARE,
        )


def make_loggers(
    wf: Workflow,
    hook: pluggy.HookRelay,
    console: Console,
    run_dir: str,
    start_step: int,
    contributed: set[str],
    config: dict[str, Any],
) -> Iterator[tuple[str, object]]:
    """``(name, logger)`` for each of ``trainer.logger``, built by its spec's factory.
    ``start_step``: the step the run starts after; ``contributed``: the names of the metrics
    plugins add, filled as they appear; ``config``: the workflow as plain data."""
    specs = logger_specs(hook)
    trainer = wf.trainer
    for name in trainer.logger:
        spec = specs[name]  # checked when the workflow was loaded
        factory = spec.factory
        if isinstance(factory, str):
            factory = load_reference(factory, f"logger '{name}': factory")
        options = trainer.logger_args.get(name)
        if options is None and spec.config_class is not None:  # a workflow built in code
            options = spec.config_class()
        context = LoggerContext(
            run_dir=run_dir,
            run_name=os.path.basename(os.path.normpath(trainer.output_dir)),
            start_step=start_step,
            max_steps=trainer.max_steps,
            config=config,
            options=options,
            console=console,
            contributed=contributed,
        )
        try:
            logger = factory(context)
        except Exception as exc:  # the tracker's own error (no login, a bad URI), shown whole
            raise UserError(
                f"logger '{name}' failed to start: {type(exc).__name__}: {exc} (check "
                f"trainer.logger_args.{name}, or leave '{name}' out of trainer.logger)"
            ) from exc
        yield name, logger
