"""How per-micro-batch and per-rank metrics combine into one step's figures.

Loss metrics are shares of global means (see :mod:`posttrain.algorithms.policy_loss`), so they
add up over micro-batches and ranks; a key ending in ``_max`` is a maximum and combines by max.
"""

from __future__ import annotations

from collections.abc import Iterable


def is_max(key: str) -> bool:
    return key.endswith("_max")


def accumulate(totals: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    """Add ``new`` into ``totals`` (in place): sums, and maxima for ``_max`` keys."""
    for key, value in new.items():
        value = float(value)
        if key in totals:
            totals[key] = max(totals[key], value) if is_max(key) else totals[key] + value
        else:
            totals[key] = value
    return totals


def combine(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for part in parts:
        accumulate(totals, part)
    return totals
