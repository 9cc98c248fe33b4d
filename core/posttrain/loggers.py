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
    """``contributed``: names of the metrics plugins add (``posttrain_step_metrics``), shown
    after the core's; the trainer fills the set as they appear."""

    def __init__(self, console, max_steps: int, contributed: set[str] | frozenset = frozenset()):
        self.console = console
        self.max_steps = max_steps
        self.contributed = contributed

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        parts = [f"step {step}/{self.max_steps}"]
        parts += [
            f"{label} {fmt.format(metrics[key])}"
            for key, label, fmt in CONSOLE_KEYS
            if key in metrics
        ]
        parts += [
            f"{key} {metrics[key]:.4g}"
            for key in sorted(self.contributed)
            if key in metrics and not key.startswith("time/")
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
    """Appends a line per step to ``metrics.jsonl``. ``start_step``: the step the run starts
    after (a resumed run's checkpoint, else 0); lines an earlier run in this directory wrote for
    later steps (a killed run's) are dropped first, so that the file holds each step once."""

    def __init__(self, run_dir: str, start_step: int = 0):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(self.path):
            self._drop_after(start_step)

    def _drop_after(self, step: int) -> None:
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        # A line cut short by a kill is not JSON: it and everything after it goes.
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] > step:
                    continue
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            kept.append(line)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class TensorboardLogger:
    def __init__(self, run_dir: str, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides what an earlier run (a killed one) logged after it.
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step + 1)

    @hookimpl
    def posttrain_log_metrics(self, step, metrics, run_dir):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    @hookimpl
    def posttrain_run_finished(self, run_dir, history):
        self.writer.close()
