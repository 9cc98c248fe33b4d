"""What a plugin declares of a metric logger (``posttrain_add_loggers``) and what the logger is
given when a run starts. A logger is a plugin object implementing ``posttrain_log_metrics``
(and, to close what it opened, ``posttrain_run_finished``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class LoggerContext:
    """What a logger's factory is given when a run starts (on the driver).

    ``start_step``: the step the run starts after (a resumed run's checkpoint, else 0); what
    an earlier run in this directory logged beyond it must not be logged twice (a killed run
    logs steps its checkpoint does not hold, and the resumed run logs them again).
    ``options``: the logger's ``trainer.logger_args`` entry, structured into the spec's
    ``config_class`` (the plain mapping without one, ``None`` when the workflow sets none and
    the spec has no class). ``config``: the whole workflow as plain YAML data, for trackers
    that record a run's configuration. ``run_name``: the last folder of
    ``trainer.output_dir``, a default name for the run.
    """

    run_dir: str
    run_name: str
    start_step: int
    max_steps: int
    config: dict[str, Any]
    options: Any = None
    # The driver's rich Console, for loggers that print.
    console: Any = None
    # Names of the metrics plugins add (posttrain_step_metrics), filled as they appear.
    contributed: set[str] | frozenset[str] = frozenset()


@attrs.frozen(kw_only=True)
class LoggerSpec:
    """A logger as declared through ``posttrain_add_loggers``, by name.

    ``factory(context)`` returns the plugin object the driver registers for the run (it
    implements ``posttrain_log_metrics``); ``context`` is a :class:`LoggerContext`. A
    ``"module:attr"`` factory is imported only when a run starts, so declaring a logger whose
    library is heavy (or missing) costs ``posttrain validate`` nothing; the module must exist.
    """

    factory: Callable[[LoggerContext], object] | str
    # An attrs class (frozen=True, kw_only=True) for the logger's trainer.logger_args entry;
    # None: the entry, if any, is passed as a plain mapping.
    config_class: type | None = None
    description: str = ""
