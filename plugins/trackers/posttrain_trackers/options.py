"""The loggers' options, ``trainer.logger_args.wandb`` and ``trainer.logger_args.mlflow``."""

from __future__ import annotations

from typing import Literal

import attrs


@attrs.frozen(kw_only=True)
class WandbOptions:
    project: str = "posttrain"
    entity: str | None = None  # null: the logged-in user's default entity
    # null: the last folder of trainer.output_dir.
    run_name: str | None = None
    group: str | None = None
    tags: list[str] = attrs.field(factory=list)
    # null: wandb's own setting (WANDB_MODE, `wandb offline`); offline writes the run under
    # RUN_DIR/wandb/ for `wandb sync`.
    mode: Literal["online", "offline", "disabled"] | None = None


@attrs.frozen(kw_only=True)
class MlflowOptions:
    # null: MLFLOW_TRACKING_URI, else MLflow's default. A file store ("file:/path/mlruns")
    # needs MLFLOW_ALLOW_FILE_STORE=true with MLflow 3.
    tracking_uri: str | None = None
    experiment_name: str = "posttrain"
    # null: the last folder of trainer.output_dir.
    run_name: str | None = None
    tags: dict[str, str] = attrs.field(factory=dict)
