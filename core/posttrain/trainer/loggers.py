"""The core's metric loggers (console, jsonl, tensorboard), declared through
``posttrain_add_loggers`` like any plugin's; each is a plugin object implementing
``posttrain_log_metrics``, registered by the trainer for the run."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from posttrain.markers import hookimpl
from posttrain.trainer.logger_spec import LoggerContext, LoggerSpec
from posttrain.trainer.step_log import StepLog

if TYPE_CHECKING:
    from rich.console import Console

# The one-line summary shows these, in this order, when present: short enough for 80 columns.
# Everything else (each phase's time, every metric) is in metrics.jsonl and TensorBoard, and a
# terminal shows the phases as progress bars.
CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/kl", "kl", "{:.3g}"),
    ("actor/entropy", "ent", "{:.3g}"),
    ("actor/clip_frac", "clip", "{:.3f}"),
)


class ConsoleLogger:
    """One line per step: ``step 12/400 reward 0.531 kl 0.0012 ent 2.84 clip 0.000 | 0.17s
    7.5k tok/s``, then the metrics plugins add (``posttrain_step_metrics``; ``contributed``: their
    names, which the trainer fills as they appear)."""

    def __init__(
        self,
        console: Console,
        max_steps: int,
        contributed: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.console = console
        self.max_steps = max_steps
        self.contributed = contributed

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        parts = [f"step {step}/{self.max_steps}"]
        parts += [
            f"{label} {fmt.format(metrics[key])}"
            for key, label, fmt in CONSOLE_KEYS
            if key in metrics
        ]
        if "time/step" in metrics:
            parts.append(f"| {metrics['time/step']:.2f}s")
        if "perf/tokens_per_s" in metrics:
            parts.append(f"{_thousands(metrics['perf/tokens_per_s'])} tok/s")
        contributed = [
            f"{key} {metrics[key]:.4g}"
            for key in sorted(self.contributed)
            if key in metrics and not key.startswith("time/")
        ]
        if contributed:
            parts.append("| " + " ".join(contributed))
        self.console.print(" ".join(parts), highlight=False, markup=False)


def _thousands(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


class JsonlLogger:
    """Appends a line per step to ``metrics.jsonl``. ``start_step``: the step the run starts
    after (a resumed run's checkpoint, else 0); what an earlier run in this directory logged
    beyond it is dropped (:class:`~posttrain.trainer.step_log.StepLog`)."""

    def __init__(self, run_dir: str, start_step: int = 0) -> None:
        self.log = StepLog(os.path.join(run_dir, "metrics.jsonl"), start_step)

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        self.log.append({"step": step, **metrics})


class TensorboardLogger:
    def __init__(self, run_dir: str, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides what an earlier run (a killed one) logged after it.
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step + 1)

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    @hookimpl
    def posttrain_run_finished(self, run_dir: str, history: list[dict[str, float]]) -> None:
        self.writer.close()


def console_logger(context: LoggerContext) -> ConsoleLogger:
    return ConsoleLogger(context.console, context.max_steps, context.contributed)


def jsonl_logger(context: LoggerContext) -> JsonlLogger:
    return JsonlLogger(context.run_dir, start_step=context.start_step)


def tensorboard_logger(context: LoggerContext) -> TensorboardLogger:
    return TensorboardLogger(context.run_dir, start_step=context.start_step)


@hookimpl(trylast=True)
def posttrain_add_loggers() -> dict[str, LoggerSpec]:
    """The core's loggers (``trylast``: a plugin declaring one of these names is reported as a
    conflict rather than silently replacing it)."""
    return {
        "console": LoggerSpec(factory=console_logger, description="one line per step"),
        "jsonl": LoggerSpec(factory=jsonl_logger, description="RUN_DIR/metrics.jsonl"),
        "tensorboard": LoggerSpec(
            factory=tensorboard_logger, description="RUN_DIR/tensorboard (torch's SummaryWriter)"
        ),
    }
