"""The ``mlflow`` logger: one MLflow run per run directory, continued when the run resumes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from posttrain import LoggerContext, hookimpl
from posttrain_trackers.run_state import RunState

# What MLflow accepts in a metric or parameter name; any other character becomes "_"
# (e.g. "val/gsm8k/pass@4" is logged as "val/gsm8k/pass_4").
_NOT_ALLOWED = re.compile(r"[^\w./\- :]")
# MLflow's limits: parameters per batch, characters per parameter value.
_PARAMS_PER_BATCH = 100
_PARAM_CHARS = 6000


def mlflow_name(name: str) -> str:
    return _NOT_ALLOWED.sub("_", name)


class MlflowLogger:
    """Logs every step's metrics at MLflow step = the training step; the workflow as the run's
    parameters (flattened, ``trainer.max_steps``) and as the artifact
    ``posttrain/workflow.json``. A resumed run continues the MLflow run it resumes and skips
    the steps that run logged already (:mod:`posttrain_trackers.run_state`)."""

    def __init__(self, context: LoggerContext):
        options = context.options
        self.client = MlflowClient(tracking_uri=options.tracking_uri)
        self.state = RunState.open(context.run_dir, "mlflow", context.start_step)
        if self.state.run_id is not None:
            run_id = self.state.run_id
            self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = self.client.get_experiment_by_name(options.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(options.experiment_name)
            )
            run = self.client.create_run(
                experiment_id,
                run_name=options.run_name or context.run_name,
                tags=dict(options.tags),
            )
            run_id = run.info.run_id
            # Parameters are set once per run (MLflow refuses a changed value): a resumed run
            # records its workflow in the artifact only.
            params = [Param(mlflow_name(k), v[:_PARAM_CHARS]) for k, v in flat(context.config)]
            for first in range(0, len(params), _PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=params[first : first + _PARAMS_PER_BATCH])
        self.client.log_dict(run_id, context.config, "posttrain/workflow.json")
        self.run_id = run_id
        self.state.start(run_id)

    @hookimpl
    def posttrain_log_metrics(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        if self.state.is_logged(step):
            return
        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)
        self.state.logged(step)

    @hookimpl
    def posttrain_run_finished(self, run_dir: str, history: list[dict[str, float]]) -> None:
        self.client.set_terminated(self.run_id)


def flat(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``("a.b.c", "value")`` for every leaf of nested mappings; lists stay whole."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from flat(inner, f"{prefix}.{key}" if prefix else str(key))
    elif prefix:
        yield prefix, str(value)
