"""Timing of the loop's phases, shown as one progress bar per phase."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

# wait_rollout: the trainer waiting for the rollout producer (asynchronous rollout only);
# evaluate: the held-out evaluation (posttrain.evaluation), on the steps it runs.
PHASES = (
    "rollout",
    "reward",
    "wait_rollout",
    "logprobs",
    "values",
    "train",
    "weight_sync",
    "checkpoint",
    "evaluate",
)


class PhaseTimer:
    """Times the phases of each step. On a terminal (``show``) each phase has a progress bar:
    steps done out of ``total_steps``, or, for the phases of ``counted`` (``{phase: (done,
    total)}``, e.g. the checkpoint's saves), runs done out of the runs the whole run makes."""

    def __init__(
        self,
        console: Console,
        total_steps: int,
        start_step: int,
        show: bool,
        counted: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.times: dict[str, float] = {}
        self.progress: Progress | None = None
        self.step = start_step
        if show and console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("{task.description:<12}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[secs]}"),
                console=console,
                transient=True,
            )
            self.total_steps, self.start_step = total_steps, start_step
            self.counted = counted or {}
            self.tasks: dict[str, TaskID] = {}  # a bar per phase, from the phase's first run
            self.progress.start()

    def at_step(self, step: int) -> None:
        """The step whose phases run next."""
        self.step = step

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.times[name] = self.times.get(name, 0.0) + elapsed
            if self.progress is not None:
                self._show(self.progress, name, elapsed)

    def _show(self, progress: Progress, name: str, elapsed: float) -> None:
        done, total = self.counted.get(name, (self.start_step, self.total_steps))
        if name not in self.tasks:
            self.tasks[name] = progress.add_task(name, total=total, completed=done, secs="")
        if name in self.counted:
            progress.update(self.tasks[name], advance=1, secs=f"{elapsed:.2f}s")
        else:  # a phase may run more than once a step (dynamic sampling's rounds)
            progress.update(self.tasks[name], completed=self.step, secs=f"{elapsed:.2f}s")

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return {f"time/{k}": v for k, v in out.items()}

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
