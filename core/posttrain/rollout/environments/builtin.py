"""The core's environments, declared by name (``trylast``: a plugin declaring the same name is
reported as a conflict rather than silently replacing them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.markers import hookimpl
from posttrain.rollout.environments.calculator import CalculatorConfig, calculator_environment
from posttrain.rollout.environments.python_sandbox import (
    PythonSandboxConfig,
    python_sandbox_environment,
)
from posttrain.rollout.environments.tools import tool_environment_spec

if TYPE_CHECKING:
    from posttrain.rollout.environments.protocol import EnvironmentSpec


@hookimpl(trylast=True)
def posttrain_add_environments() -> dict[str, EnvironmentSpec]:
    return {
        "calculator": tool_environment_spec(
            calculator_environment,
            CalculatorConfig,
            "integer arithmetic (+ - *) as a tool, in compact, hermes or llama3_json call syntax",
        ),
        "python_sandbox": tool_environment_spec(
            python_sandbox_environment,
            PythonSandboxConfig,
            "a python tool: the model's code runs in a sandbox, its output is the observation",
        ),
    }
