"""Declares the ``wandb`` and ``mlflow`` loggers. Cheap to import: the trackers' libraries are
imported by the factories, when a run that names them starts."""

from __future__ import annotations

from posttrain import LoggerSpec, hookimpl
from posttrain_trackers.options import MlflowOptions, WandbOptions


@hookimpl
def posttrain_add_loggers():
    return {
        "wandb": LoggerSpec(
            factory="posttrain_trackers.wandb_logger:WandbLogger",
            config_class=WandbOptions,
            description="Weights & Biases (pip install 'posttrain-trackers[wandb]')",
        ),
        "mlflow": LoggerSpec(
            factory="posttrain_trackers.mlflow_logger:MlflowLogger",
            config_class=MlflowOptions,
            description="MLflow tracking (pip install 'posttrain-trackers[mlflow]')",
        ),
    }
