"""Timing of the loop's phases, shown as one progress bar per phase."""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("rollout", "reward", "logprobs", "values", "train", "weight_sync", "checkpoint")


class PhaseTimer:
    def __init__(self, console, total_steps: int, start_step: int, show: bool):
        self.times: dict[str, float] = {}
        self.progress = None
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
            self.tasks = {
                p: self.progress.add_task(p, total=total_steps, completed=start_step, secs="")
                for p in PHASES
            }
            self.progress.start()

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.times[name] = self.times.get(name, 0.0) + elapsed
            if self.progress is not None:
                self.progress.update(self.tasks[name], advance=1, secs=f"{elapsed:.2f}s")

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return {f"time/{k}": v for k, v in out.items()}

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
