"""The environments plugins declare (``posttrain_add_environments``), by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from posttrain.environments.protocol import Environment, EnvironmentSpec
from posttrain.errors import UserError
from posttrain.plugin_host import declared_by_name


def environment_specs(hook) -> dict[str, EnvironmentSpec]:
    """Every declared environment; one name declared by two plugins is an error naming both."""
    return declared_by_name(hook.posttrain_add_environments, "environment")


def environment_factory(name: str, spec: EnvironmentSpec) -> Callable[[Any], Environment]:
    """The spec's factory, imported now when it is given as ``"module:attr"``."""
    if callable(spec.factory):
        return spec.factory
    module_name, sep, attr = spec.factory.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(
            f"environment '{name}': factory '{spec.factory}' is not of the form 'module:attr'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"environment '{name}': cannot import module '{module_name}' ({exc})"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"environment '{name}': module '{module_name}' has no factory '{attr}'")
    return factory
