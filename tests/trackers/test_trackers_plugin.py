"""posttrain-trackers without a run: its entry point is cheap, its options are checked by
``posttrain validate`` and documented, and the record that lets a resumed run continue its
tracker run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs

from posttrain.host.plugin_host import create_plugin_host
from posttrain.loading.workflow import load_workflow
from posttrain_trackers.mlflow_logger import flat, mlflow_name
from posttrain_trackers.options import MlflowOptions, WandbOptions
from posttrain_trackers.run_state import RunState

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def test_the_entry_point_imports_neither_tracker():
    code = (
        "import sys; import posttrain_trackers.plugin; "
        "print(sorted(m for m in ('wandb', 'mlflow', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tracker_options_are_typed_and_checked_before_anything_starts():
    host = create_plugin_host()
    workflow, report = load_workflow(
        str(QUICKSTART),
        host,
        overrides={
            "trainer.logger": ["console", "wandb", "mlflow"],
            "trainer.logger_args": {"wandb": {"project": "p", "tags": ["a"]}},
        },
    )
    assert not report.errors
    args = workflow.trainer.logger_args
    assert args == {"wandb": WandbOptions(project="p", tags=["a"]), "mlflow": MlflowOptions()}

    _, report = load_workflow(
        str(QUICKSTART),
        host,
        overrides={
            "trainer.logger": ["wandb", "mlflw"],
            "trainer.logger_args": {"wandb": {"projct": "p", "mode": "offlin"}},
        },
    )
    by_path = {e.path: e for e in report.errors}
    assert set(by_path) == {
        "trainer.logger[1]",
        "trainer.logger_args.wandb.projct",
        "trainer.logger_args.wandb.mode",
    }
    assert "did you mean 'mlflow'?" in by_path["trainer.logger[1]"].hint
    assert "did you mean 'project'" in by_path["trainer.logger_args.wandb.projct"].hint
    assert "did you mean 'offline'" in by_path["trainer.logger_args.wandb.mode"].hint


def test_every_option_is_documented():
    text = (REPO / "docs" / "trackers.md").read_text()
    for cls, section in ((WandbOptions, "wandb"), (MlflowOptions, "mlflow")):
        table = text.split(f"`trainer.logger_args.{section}`:")[1].split("\n\n", 2)[1]
        documented = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
        assert documented == [f.name for f in attrs.fields(cls)], section


def test_a_resumed_run_continues_the_recorded_tracker_run(tmp_path):
    fresh = RunState.open(str(tmp_path), "wandb", start_step=0)
    assert fresh.run_id is None and not fresh.is_logged(1)
    fresh.start("run-1")
    for step in (1, 2, 3):
        fresh.logged(step)
    # This run may send a step in several calls (training metrics, then an evaluation's).
    assert not fresh.is_logged(3)
    # Resumed from the checkpoint of step 2: step 3 is in the tracker already.
    resumed = RunState.open(str(tmp_path), "wandb", start_step=2)
    assert resumed.run_id == "run-1"
    assert resumed.is_logged(3) and not resumed.is_logged(4)
    # A run from step 0 in the same directory is a new tracker run.
    assert RunState.open(str(tmp_path), "wandb", start_step=0).run_id is None
    # Resumed, but the tracker was not on before: a new run, nothing skipped.
    other = RunState.open(str(tmp_path), "mlflow", start_step=2)
    assert other.run_id is None and not other.is_logged(1)


def test_mlflow_names_and_parameters():
    assert mlflow_name("val/gsm8k/pass@4") == "val/gsm8k/pass_4"
    assert mlflow_name("reward/mean") == "reward/mean"
    config = {"trainer": {"max_steps": 3, "logger": ["jsonl"]}, "critic": None, "plugins": []}
    assert list(flat(config)) == [
        ("trainer.max_steps", "3"),
        ("trainer.logger", "['jsonl']"),
        ("critic", "None"),
        ("plugins", "[]"),
    ]
