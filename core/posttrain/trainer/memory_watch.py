"""A watch on memory that keeps growing: the ranks' and the driver's resident memory and each
phase's peak GPU memory (the step's ``memory/*`` figures), against what they were once the run
settled. Memory that creeps up step after step (an engine's sleep mode leaving a little more
behind each time, a cache nobody empties) ends a long colocated run hours in; this says so while
there is time to act."""

from __future__ import annotations

from collections.abc import Callable

# Steps whose figures set the baseline (the first steps allocate what the run keeps: optimizer
# state, caches, compiled graphs).
SETTLE_STEPS = 5
# Growth over the baseline that is reported: both a fraction and an amount, so that a few
# hundred MiB of noise on a small process, or 1% of a large one, says nothing.
GROWTH = 0.10
FLOOR_GIB = 0.25


class MemoryWatch:
    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.steps = 0
        self.baseline: dict[str, float] = {}
        self.reported: dict[str, float] = {}  # the figure of the last warning, per key

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Take the step's ``memory/*`` figures; warn once a figure grew past the baseline, and
        again each time it grows as much further."""
        self.steps += 1
        for key, value in metrics.items():
            if not key.startswith("memory/"):
                continue
            if self.steps <= SETTLE_STEPS:
                self.baseline[key] = max(self.baseline.get(key, 0.0), value)
                continue
            base = self.baseline.get(key)
            if base is None:  # a figure the first steps did not have
                self.baseline[key] = value
                continue
            last = self.reported.get(key, base)
            if value > last * (1 + GROWTH) and value - last > FLOOR_GIB:
                self.reported[key] = value
                self.say(
                    f"warning: {key} grew from {base:.2f} GiB (the run's first "
                    f"{SETTLE_STEPS} steps) to {value:.2f} GiB at step {step} "
                    f"(+{(value / base - 1) * 100:.0f}%): memory that keeps growing ends a long "
                    "run (docs/reliability.md)"
                )
