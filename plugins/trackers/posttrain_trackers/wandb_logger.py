"""The ``wandb`` logger: one W&B run per run directory, continued when the run resumes."""

from __future__ import annotations

import uuid

import wandb

from posttrain import LoggerContext, hookimpl
from posttrain_trackers.run_state import RunState


class WandbLogger:
    """Logs every step's metrics at W&B step = the training step, the workflow as the run's
    config. A resumed run continues the W&B run it resumes (same id, ``resume="allow"``) and
    skips the steps that run logged already (:mod:`posttrain_trackers.run_state`)."""

    def __init__(self, context: LoggerContext):
        options = context.options
        self.state = RunState.open(context.run_dir, "wandb", context.start_step)
        run_id = self.state.run_id or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=options.project,
            entity=options.entity,
            name=options.run_name or context.run_name,
            group=options.group,
            tags=list(options.tags) or None,
            mode=options.mode,
            id=run_id,
            resume="allow",
            dir=context.run_dir,  # its files go under RUN_DIR/wandb/
            config=context.config,
        )
        self.state.start(run_id)

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        if self.state.is_logged(step):
            return
        self.run.log(dict(metrics), step=step)
        self.state.logged(step)

    @hookimpl
    def posttrain_run_finished(self, run_dir: str, history: list[dict[str, float]]) -> None:
        self.run.finish()
