"""The ``csv`` logger: a few chosen metrics of every step in ``RUN_DIR/<file>``, one row per
step, for a spreadsheet. Named in ``trainer.logger``; its options are
``trainer.logger_args.csv`` (:class:`CsvOptions`)."""

from __future__ import annotations

import csv
import os

import attrs

from posttrain import LoggerContext, hookimpl


@attrs.frozen(kw_only=True)
class CsvOptions:
    file: str = "metrics.csv"
    # The columns after "step"; a metric a step lacks is left empty.
    keys: list[str] = attrs.field(factory=lambda: ["reward/mean"])


class CsvLogger:
    def __init__(self, context: LoggerContext):
        options: CsvOptions = context.options
        self.keys = list(options.keys)
        self.path = os.path.join(context.run_dir, options.file)
        # A resumed run starts after its checkpoint's step: the rows a killed run wrote after
        # it are dropped, so that each step has one row.
        kept = []
        if context.start_step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= context.start_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, ["step", *self.keys], extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([step, *(metrics.get(key, "") for key in self.keys)])
