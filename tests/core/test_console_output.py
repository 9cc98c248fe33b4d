"""What a run prints: a metrics line that fits 80 columns, and progress bars that count steps
(or, for checkpoints, saves)."""

from __future__ import annotations

import io

from rich.console import Console

from posttrain.trainer.loggers import ConsoleLogger
from posttrain.trainer.phase_timer import PhaseTimer

STEP = {
    "reward/mean": 0.921875,
    "actor/kl": 0.143512,
    "actor/entropy": 2.83612,
    "actor/clip_frac": 0.000123,
    "perf/tokens_per_s": 7508.2,
    "time/step": 0.1712,
    "time/rollout": 0.01,
    "time/train": 0.06,
    "time/outside_phases": 0.01,
    "reward/max": 1.0,
}


def test_the_metrics_line_fits_80_columns():
    out = io.StringIO()
    console = Console(file=out, width=80)
    ConsoleLogger(console, max_steps=4000).posttrain_log_metrics(4000, STEP, "run")
    line = out.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= 80, line
    assert line == ("step 4000/4000 reward 0.922 kl 0.144 ent 2.84 clip 0.000 | 0.17s 7.5k tok/s")


def test_plugin_metrics_follow_the_cores():
    out = io.StringIO()
    logger = ConsoleLogger(Console(file=out, width=200), 10, {"example/syncs", "time/example"})
    logger.posttrain_log_metrics(3, {**STEP, "example/syncs": 4.0, "time/example": 0.2}, "run")
    assert out.getvalue().rstrip().endswith("tok/s | example/syncs 4")


def test_bars_count_steps_and_the_checkpoint_bar_counts_saves():
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    timer = PhaseTimer(console, 400, 100, show=True, counted={"checkpoint": (1, 4)})
    for step in (101, 102):
        timer.at_step(step)
        for _ in range(2):  # two rounds of dynamic sampling: still one step
            with timer.phase("rollout"):
                pass
    with timer.phase("checkpoint"):
        pass
    timer.stop()
    bars = {task.description: task for task in timer.progress.tasks}
    assert (bars["rollout"].completed, bars["rollout"].total) == (102, 400)
    assert (bars["checkpoint"].completed, bars["checkpoint"].total) == (2, 4)
