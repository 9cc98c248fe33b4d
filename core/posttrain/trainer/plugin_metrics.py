"""Metrics that plugins add to each step (``posttrain_step_metrics``), checked and merged so
that every logger and the history receive them like the core's own."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from posttrain.errors import PluginError

if TYPE_CHECKING:
    from posttrain.host.plugin_host import PluginHost


def contributed_metrics(host: PluginHost, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """Every plugin's metrics for ``step``; ``metrics`` (the core's) is shown read-only."""
    added: dict[str, float] = {}
    owners: dict[str, str] = {}
    for plugin, answer in host.answers_by_plugin(
        "posttrain_step_metrics", step=step, metrics=MappingProxyType(metrics)
    ):
        if not isinstance(answer, Mapping):
            raise PluginError(
                f"plugin '{plugin}': posttrain_step_metrics returned {type(answer).__name__}; "
                "expected a dict of metric name -> number"
            )
        for name, value in answer.items():
            if not isinstance(name, str) or not name:
                raise PluginError(f"plugin '{plugin}': metric name {name!r} is not a string")
            if name in metrics:
                raise PluginError(
                    f"plugin '{plugin}': metric '{name}' is one the core reports; "
                    "give yours a name of its own (e.g. prefixed with the plugin's name)"
                )
            if name in owners:
                raise PluginError(
                    f"metric '{name}' is reported by two plugins: '{owners[name]}' and '{plugin}'"
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise PluginError(
                    f"plugin '{plugin}': metric '{name}' is {value!r} "
                    f"({type(value).__name__}); expected a real number"
                )
            owners[name] = plugin
            added[name] = float(value)
    return added
