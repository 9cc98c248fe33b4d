"""Reward functions of the example plugin (imported only when a workflow resolves them)."""

from __future__ import annotations

import re

_DIGIT = re.compile(r"\d")


def digit_match(completion: str, answer: str, prompt: str = "", **kwargs: object) -> float:
    """1.0 when the first digit in the completion equals the first digit of the answer."""
    found = _DIGIT.search(completion)
    expected = _DIGIT.search(str(answer))
    if found is None or expected is None:
        return 0.0
    return 1.0 if found.group() == expected.group() else 0.0
