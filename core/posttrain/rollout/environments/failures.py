"""What a step's environment failures leave behind: each one, with its episode id and traceback,
in ``RUN_DIR/logs/environments.log``; one line on the console per step (at 1,000 episodes a
step, a line per episode would bury the run); a warning when every episode of a step failed,
and a stop after ``environment.max_failed_steps`` such steps in a row."""

from __future__ import annotations

import logging
import os
import time

import attrs

from posttrain.errors import UserError
from posttrain.paths import display_path

log = logging.getLogger("posttrain.rollout.environments.runner")

LOG_FILE = "environments.log"


@attrs.frozen
class Failure:
    episode_id: str
    message: str  # "turn 1: step() raised RuntimeError: ..."
    kind: str = "errors"  # or "timeouts": the env/ metric it counts in
    traceback: str | None = None


class FailureLog:
    """The failures of one environment over a run; ``log_dir``: RUN_DIR/logs (None: no file)."""

    def __init__(self, name: str, log_dir: str | None, max_failed_steps: int):
        self.name = name
        self.path = os.path.join(log_dir, LOG_FILE) if log_dir else None
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0  # steps in a row whose every episode failed

    def step_done(self, where: str, failures: list[Failure], episodes: int) -> None:
        """Log ``where``'s failures (out of ``episodes``) in one console line; raise when too
        many whole steps failed in a row."""
        whole = bool(failures) and len(failures) == episodes
        self.failed_steps = self.failed_steps + 1 if whole else 0
        if not failures:
            return
        self._write(where, failures, episodes)
        first = failures[0]
        if self.failed_steps >= self.max_failed_steps:
            raise UserError(
                f"environment '{self.name}': every episode failed in {self.failed_steps} "
                f"step(s) in a row (environment.max_failed_steps: {self.max_failed_steps}); "
                f"the run stops rather than train on nothing. The first failure of {where}: "
                f"{first.episode_id}: {first.message}; {self._where_logged()}. Fix the "
                "environment, or raise environment.max_failed_steps"
            )
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(_kinds(failures).items()))
        streak = (
            f"; EVERY episode failed ({self.failed_steps} step(s) in a row; the run stops at "
            f"environment.max_failed_steps: {self.max_failed_steps})"
            if whole
            else ""
        )
        log.warning(
            "environment '%s': %s: %d of %d episodes failed and score 0 (%s); first: %s: %s; %s%s",
            self.name,
            where,
            len(failures),
            episodes,
            kinds,
            first.episode_id,
            first.message,
            self._where_logged(),
            streak,
        )

    def _where_logged(self) -> str:
        if self.path is None:
            return "no log file (no run directory)"
        return f"every failure with its traceback: {display_path(self.path)}"

    def _write(self, where: str, failures: list[Failure], episodes: int) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        lines = [f"== {stamp} environment '{self.name}', {where}: {len(failures)} of {episodes}"]
        for failure in failures:
            lines.append(f"{failure.episode_id}: {failure.message}")
            if failure.traceback:
                lines.append(failure.traceback.rstrip())
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


def _kinds(failures: list[Failure]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for failure in failures:
        kinds[failure.kind] = kinds.get(failure.kind, 0) + 1
    return kinds
