"""Rule-based rewards and the resolution of ``reward.function`` from YAML.

A reward function is called once per sample: ``fn(completion, answer, prompt, **kwargs) -> float``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from posttrain.config.report import did_you_mean
from posttrain.errors import UserError
from posttrain.host.plugin_host import declared_by_name
from posttrain.host.references import (
    WHERE_MODULES_ARE,
    load_reference,
    missing_module,
    split_reference,
)

if TYPE_CHECKING:
    import pluggy

    from posttrain.config.report import ErrorReport

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


def reward_function_names(hook: pluggy.HookRelay) -> dict[str, str]:
    """Every registered reward name; one name declared by two plugins is an error naming both."""
    return declared_by_name(hook.posttrain_add_reward_functions, "reward function")


def resolve_reward_function(spec: str, hook: pluggy.HookRelay) -> RewardFn:
    """A registered name (``exact_match``) or ``module:function``; a clear UserError otherwise."""
    names = reward_function_names(hook)
    target = names.get(spec, spec)
    if split_reference(target) is None:
        raise UserError(
            f"reward.function: '{spec}' is neither a registered reward "
            f"({', '.join(sorted(names))}) nor of the form 'module:function'"
        )
    fn = load_reference(target, "reward.function")
    if not callable(fn):
        raise UserError(f"reward.function: '{target}' is not a function")
    return fn


def check_reward_function(
    function: str | None,
    hook: pluggy.HookRelay,
    report: ErrorReport,
    where: str = "reward.function",
) -> None:
    """Report a ``reward.function`` (or the function at YAML path ``where``) that names no
    registered reward, or a module that cannot be found (before anything starts, without
    importing it)."""
    if not function:
        return
    try:
        names = reward_function_names(hook)
    except UserError as exc:  # two plugins declare one name
        report.error("plugins", str(exc))
        return
    reference = split_reference(names.get(function, function))
    if reference is None:
        close = did_you_mean(function, names)
        hint = f"{close} " if close.startswith("did you mean") else ""
        report.error(
            where,
            f"'{function}' is neither a registered reward nor of the form 'module:function'",
            f"{hint}registered: {', '.join(sorted(names))}",
        )
        return
    problem = missing_module(reference[0])
    if problem:
        owner = f" (registered as '{function}')" if function in names else ""
        report.error(where, problem + owner, WHERE_MODULES_ARE)
