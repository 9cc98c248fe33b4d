"""Allowed ranges of numeric config fields, declared once, on the field itself.

    group_size: int = attrs.field(default=8, validator=at_least(1))
    top_p: float = attrs.field(default=1.0, validator=between(0, 1, low_open=True))
    max_steps: int = attrs.field(default=-1, validator=at_least(1, also={-1: "unused"}))

A :class:`Range` is an attrs validator, so an instance built in Python is checked too. The
workflow converter finds it on the field (:func:`range_of`) and checks every ranged field of a
mapping itself, so that all violations are reported at once, each with its YAML path; the config
reference prints it in the type column. Plugins' ``strategy_config`` classes use the same helpers.
``None`` always passes: whether null is allowed is the field type's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

Number = int | float


@attrs.frozen(kw_only=True)
class Range:
    """An interval, plus single values outside it that keep a meaning (``-1``: unused)."""

    low: Number | None = None
    high: Number | None = None
    low_open: bool = False
    high_open: bool = False
    # (value, meaning) pairs, e.g. ((-1, "unused"),): accepted although outside the interval.
    also: tuple[tuple[Number, str], ...] = ()

    def admits(self, value: Number) -> bool:
        if any(value == special for special, _ in self.also):
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """``>= 1``, ``> 0``, ``in (0, 1]``, ``>= 1, or -1 (unused)``."""
        if self.low is not None and self.high is not None:
            text = (
                f"in {'(' if self.low_open else '['}{self.low}, "
                f"{self.high}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high}"
        meanings: dict[str, list[str]] = {}
        for value, meaning in self.also:
            meanings.setdefault(meaning, []).append(str(value))
        for meaning, values in meanings.items():
            text += f", or {' or '.join(values)} ({meaning})"
        return text

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not self.admits(value):
            raise OutOfRange(value, self, attribute.name)


class OutOfRange(ValueError):
    """A value outside its field's :class:`Range`; the converter reports it with its YAML path."""

    def __init__(self, value: Number, allowed: Range, name: str = ""):
        self.value = value
        self.allowed = allowed
        self.detail = f"{value!r} is out of range; allowed: {allowed.describe()}"
        super().__init__(f"{name}: {self.detail}" if name else self.detail)


def _specials(also: Mapping[Number, str] | None) -> tuple[tuple[Number, str], ...]:
    return tuple((also or {}).items())


def at_least(minimum: Number, *, also: Mapping[Number, str] | None = None) -> Range:
    """``value >= minimum``; counts and sizes are ``at_least(1)``."""
    return Range(low=minimum, also=_specials(also))


def greater_than(minimum: Number, *, also: Mapping[Number, str] | None = None) -> Range:
    """``value > minimum``, e.g. a timeout: ``greater_than(0)``."""
    return Range(low=minimum, low_open=True, also=_specials(also))


def between(
    low: Number,
    high: Number,
    *,
    low_open: bool = False,
    high_open: bool = False,
    also: Mapping[Number, str] | None = None,
) -> Range:
    """``low <= value <= high``; ``low_open`` / ``high_open`` exclude an end: a probability
    such as top_p is ``between(0, 1, low_open=True)``, i.e. in (0, 1]."""
    return Range(low=low, high=high, low_open=low_open, high_open=high_open, also=_specials(also))


def range_of(field: attrs.Attribute) -> Range | None:
    """The :class:`Range` declared as ``field``'s validator, if any."""
    return field.validator if isinstance(field.validator, Range) else None
