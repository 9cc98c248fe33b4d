"""Metric loggers named in ``trainer.logger``; each is a plugin object implementing
``posttrain_log_metrics``, registered by the trainer for the run."""

from __future__ import annotations

import json
import os

from posttrain import hookimpl

# The one-line summary shows these, in this order, when present.
CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("actor/clip_frac", "clip", "{:.3f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("time/step", "step_s", "{:.2f}"),
)


class ConsoleLogger:
    def __init__(self, console, max_steps: int):
        self.console = console
        self.max_steps = max_steps

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        parts = [f"step {step}/{self.max_steps}"]
        parts += [
            f"{label} {fmt.format(metrics[key])}"
            for key, label, fmt in CONSOLE_KEYS
            if key in metrics
        ]
        phases = [
            f"{k.split('/', 1)[1]} {v:.2f}s"
            for k, v in metrics.items()
            if k.startswith("time/") and k != "time/step"
        ]
        if phases:
            parts.append("[" + ", ".join(phases) + "]")
        self.console.print(" | ".join(parts), highlight=False, markup=False)


class JsonlLogger:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "metrics.jsonl")

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class TensorboardLogger:
    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    @hookimpl
    def posttrain_run_finished(self, run_dir, history):
        self.writer.close()
