"""Rule-based rewards and the resolution of ``reward.function`` from YAML.

A reward function is called once per sample: ``fn(completion, answer, prompt, **kwargs) -> float``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from posttrain.errors import UserError
from posttrain.plugin_host import declared_by_name

RewardFn = Callable[..., float]


def exact_match(completion: str, answer: str, prompt: str = "", **_: object) -> float:
    """1.0 when the completion, stripped, equals the answer, stripped."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_match(
    completion: str, answer: str, prompt: str = "", tolerance: float = 1e-6, **_: object
) -> float:
    """1.0 when the last number in the completion equals the answer's number."""
    found = _NUMBER.findall(completion.replace(",", ""))
    expected = _NUMBER.findall(str(answer).replace(",", ""))
    if not found or not expected:
        return 0.0
    return 1.0 if abs(float(found[-1]) - float(expected[-1])) <= tolerance else 0.0


def reward_function_names(hook) -> dict[str, str]:
    """Every registered reward name; one name declared by two plugins is an error naming both."""
    return declared_by_name(hook.posttrain_add_reward_functions, "reward function")


def resolve_reward_function(spec: str, hook) -> RewardFn:
    """A registered name (``exact_match``) or ``module:function``; a clear UserError otherwise."""
    names = reward_function_names(hook)
    target = names.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(
            f"reward.function: '{spec}' is neither a registered reward "
            f"({', '.join(sorted(names))}) nor of the form 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"reward.function: cannot import module '{module_name}' ({exc}); "
            "is it on PYTHONPATH or next to the workflow file?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"reward.function: module '{module_name}' has no function '{attr}'")
    return fn
