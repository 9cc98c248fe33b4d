"""The driver's hang watchdog: a call that runs past ``cluster.hang_report_s`` gets every
process's Python stacks written under ``RUN_DIR/hangs/step-N/`` and one summary printed (which
process is in which function, which collective each waits in). The run goes on waiting until
``cluster.call_timeout_s``: a slow step is not a dead one, and the report costs the run nothing.

``hang_report_s: auto`` reports a call once it has run ``AUTO_FACTOR`` times the median of the
same call's earlier durations (its first, a warm-up, left out), at least ``AUTO_MIN_S``; until
two such durations are known, after ``AUTO_FIRST_S``. Never later than half of
``call_timeout_s``, so that a report always comes before the run gives up.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

from posttrain.launch.stacks import (
    StackTarget,
    collect_stacks,
    file_head,
    install_stack_dump,
    summary_lines,
    target,
    this_node,
)
from posttrain.paths import display_path

AUTO_FACTOR = 10.0
AUTO_MIN_S = 60.0
AUTO_FIRST_S = 600.0


class HangWatch:
    def __init__(
        self,
        run_dir: str,
        report_s: float | None,
        call_timeout_s: float,
        show: Callable[[str], None],
        device: str = "cpu",
        own: tuple[StackTarget, ...] = (),
    ):
        """``report_s``: seconds, or None for the automatic threshold; ``show`` prints the
        summary; ``own``: processes to ask besides the launcher's ranks (the driver)."""
        self.run_dir = run_dir
        self.report_s = report_s
        self.call_timeout_s = call_timeout_s
        self.own = own
        self.launcher: Any = None  # set by the launcher that reports to this watch
        self.show = show
        self.device = device
        self.step = 0
        self._durations: dict[tuple[str, str], list[float]] = {}
        self._reported: set = set()
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()

    @classmethod
    def for_driver(
        cls, run_dir: str, cluster: Any, show: Callable[[str], None], device: str
    ) -> HangWatch:
        """The driver's watchdog over every call to the ranks (docs/hangs.md), with the
        ``cluster`` section's thresholds; the driver's own stacks can be asked for too."""
        stacks = os.path.join(run_dir, "logs", "driver.stacks")
        install_stack_dump(stacks)
        if device == "cuda":  # where NCCL's flight recorder is dumped (rank_env)
            os.makedirs(os.path.join(run_dir, "hangs"), exist_ok=True)
        return cls(
            run_dir,
            cluster.hang_report_s,
            cluster.call_timeout_s,
            show=show,
            device=device,
            own=(target("driver", os.getpid(), this_node(), stacks),),
        )

    def targets(self) -> list[StackTarget]:
        """Every process of the run: the driver and each rank the launcher started."""
        ranks = self.launcher.stack_targets() if self.launcher is not None else []
        return [*self.own, *ranks]

    def threshold(self, role: str, method: str) -> float:
        if self.report_s is not None:
            return self.report_s
        earlier = self._durations.get((role, method), [])[1:]  # the first is a warm-up
        auto = (
            max(AUTO_MIN_S, AUTO_FACTOR * statistics.median(earlier))
            if len(earlier) >= 2
            else AUTO_FIRST_S
        )
        return min(auto, self.call_timeout_s / 2)

    def finished(self, role: str, method: str, seconds: float) -> None:
        with self._lock:
            self._durations.setdefault((role, method), []).append(seconds)

    def check(self, call: object, role: str, method: str, elapsed: float) -> None:
        """Called by a launcher while it waits for ``call``: report it once when it has run
        past the threshold."""
        limit = self.threshold(role, method)
        if elapsed < limit:
            return
        with self._lock:
            if call in self._reported:
                return
            self._reported.add(call)
        self.report(f"{role}.{method} has run {elapsed:.0f}s", limit)

    def report(self, why: str, limit: float | None = None) -> str:
        """Take every process's stacks, write them under ``RUN_DIR/hangs/step-N/`` and show the
        summary; returns that directory."""
        with self._report_lock:  # the loop's and the rollout producer's threads may both ask
            return self._report(why, limit)

    def _report(self, why: str, limit: float | None) -> str:
        out = _fresh_dir(os.path.join(self.run_dir, "hangs", f"step-{self.step}"))
        targets = self.targets()
        dumps = collect_stacks(targets)
        heads = {t.label: file_head(t.stacks_path) for t in targets}
        lines = summary_lines(dumps, heads)
        for t in targets:
            name = t.label.replace(" ", "_").replace("+", "_") + ".txt"
            with open(os.path.join(out, name), "w", encoding="utf-8") as f:
                f.write(f"{t.label} (pid {t.pid}, node {t.node})\n{dumps[t.label]}")
        text = "\n".join(
            [
                f"hang report (step {self.step}): {why}"
                + (f" (past cluster.hang_report_s: {limit:.0f}s)" if limit is not None else ""),
                *(f"  {line}" for line in lines),
                f"every process's stacks: {display_path(out)}",
                *(
                    [
                        "NCCL's flight recorder is written to "
                        f"{display_path(os.path.join(self.run_dir, 'hangs'))}/nccl_trace_rank_* "
                        "when a collective times out (cluster.collective_timeout_s)"
                    ]
                    if self.device == "cuda"
                    else []
                ),
                f"the run waits until cluster.call_timeout_s ({self.call_timeout_s:.0f}s)",
            ]
        )
        with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        self.show(text)
        return out


def _fresh_dir(path: str) -> str:
    """``path``, or ``path-2``, ``path-3``... when a report of the same step exists."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    os.makedirs(candidate)
    return candidate
