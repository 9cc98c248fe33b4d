"""The environments plugins declare (``posttrain_add_environments``), by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from posttrain.errors import UserError
from posttrain.host.plugin_host import declared_by_name
from posttrain.host.references import load_reference
from posttrain.rollout.environments.protocol import Environment, EnvironmentSpec

if TYPE_CHECKING:
    import pluggy

    from posttrain.config.sections import EnvironmentConfig


def environment_specs(hook: pluggy.HookRelay) -> dict[str, EnvironmentSpec]:
    """Every declared environment; one name declared by two plugins is an error naming both."""
    return declared_by_name(hook.posttrain_add_environments, "environment")


def environment_factory(name: str, spec: EnvironmentSpec) -> Callable[[Any], Environment]:
    """The spec's factory, imported now when it is given as ``"module:attr"``."""
    if callable(spec.factory):
        return spec.factory
    factory = load_reference(spec.factory, f"environment '{name}': factory")
    if not callable(factory):
        raise UserError(f"environment '{name}': factory '{spec.factory}' is not callable")
    return factory


def prompt_tools(config: EnvironmentConfig, hook: pluggy.HookRelay) -> list[dict[str, Any]] | None:
    """The tool schemas prompts are rendered with (``apply_chat_template(tools=...)``) under the
    workflow's ``environment`` section (its kwargs structured); None without an environment or
    without tools."""
    if config.name is None:
        return None
    spec = environment_specs(hook)[config.name]
    return spec.tool_schemas(config.kwargs) or None
