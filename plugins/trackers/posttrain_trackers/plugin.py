"""Declares the ``wandb`` and ``mlflow`` loggers, and their libraries for ``posttrain doctor``.
Cheap to import: the trackers' libraries are imported by the factories, when a run that names
them starts."""

from __future__ import annotations

from posttrain import EnvCheck, LoggerSpec, hookimpl, module_version
from posttrain_trackers.options import MlflowOptions, WandbOptions


@hookimpl
def posttrain_add_loggers() -> dict[str, LoggerSpec]:
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


# The versions the tests ran with (tests/trackers); each tracker is an optional extra.
TESTED_WANDB = ">=0.19,<1"
TESTED_MLFLOW = ">=2.16,<4"


@hookimpl
def posttrain_environment_checks() -> list[EnvCheck]:
    # mlflow-skinny and mlflow are both imported as mlflow: asked of the module, not of one
    # distribution.
    return [
        EnvCheck(plugin="posttrain-trackers", package="wandb", tested=TESTED_WANDB, required=False),
        EnvCheck(
            plugin="posttrain-trackers",
            package="mlflow",
            tested=TESTED_MLFLOW,
            required=False,
            version_getter=module_version("mlflow"),
        ),
    ]
