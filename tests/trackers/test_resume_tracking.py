"""The wandb and mlflow loggers in a real run that resumes: an offline W&B run and an MLflow
file-store run are read back and hold every step's metrics once, in one tracker run.

The first run stops after step 3 with its checkpoint at step 2 (no final save), as a run
killed between checkpoints leaves it: step 3 is logged but not saved. The second run resumes
from step 2, runs step 3 again and step 4; the trackers must not hold step 3 twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import wandb_records
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"


def run(run_dir: Path, tracking_uri: str, max_steps: int) -> str:
    overrides = {
        "trainer.output_dir": str(run_dir),
        "trainer.max_steps": max_steps,
        "trainer.save_steps": 2,
        "trainer.save_final": "false",
        "trainer.resume": "auto",
        "trainer.progress": "false",
        "trainer.logger": "[console,jsonl,wandb,mlflow]",
        "trainer.logger_args.wandb.project": "posttrain-tests",
        "trainer.logger_args.wandb.tags": "[ci]",
        "trainer.logger_args.mlflow.tracking_uri": tracking_uri,
        "trainer.logger_args.mlflow.experiment_name": "resume-test",
        # The smallest run: one rank process, 4 prompts x 4 samples.
        "algorithm.rollout_batch_size": 4,
        "algorithm.group_size": 4,
        **{f"{role}.device_mapping": "[0]" for role in ("actor_train", "actor_infer", "reference")},
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        # MLflow 3 keeps its file store behind this switch.
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", str(QUICKSTART), *sets],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return " ".join(proc.stdout.split())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wandb_and_mlflow_hold_every_step_once_across_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reads
    run_dir = tmp_path / "tracked-run"
    tracking_uri = f"file:{tmp_path / 'mlruns'}"
    first = run(run_dir, tracking_uri, max_steps=3)
    assert "done: 3 steps this run (steps 1-3)" in first
    assert not (run_dir / "checkpoint-3").exists()
    second = run(run_dir, tracking_uri, max_steps=4)
    assert "resumed from" in second and "at step 2" in second
    assert "done: 2 steps this run (steps 3-4)" in second
    # The run's own log, each step once: the reference values.
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    reward = {m["step"]: m["reward/mean"] for m in logged}
    kl = {m["step"]: m["actor/kl"] for m in logged}

    # W&B: one offline run file per process, both of the same run id and name.
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    runs = [wandb_records.run_record(f) for f in files]
    recorded = json.loads((run_dir / "trackers" / "wandb.json").read_text())
    assert {r.run_id for r in runs} == {recorded["run_id"]}
    assert {(r.display_name, r.project) for r in runs} == {("tracked-run", "posttrain-tests")}
    assert list(runs[0].tags) == ["ci"]
    rows = [row for f in files for row in wandb_records.history(f)]
    assert sorted(row["_step"] for row in rows) == [1, 2, 3, 4]  # step 3 once
    assert [row["_step"] for row in wandb_records.history(files[1])] == [4]
    assert {row["_step"]: row["reward/mean"] for row in rows} == reward
    assert {row["_step"]: row["actor/kl"] for row in rows} == kl
    # The workflow is the run's config; the resumed run's has its new max_steps.
    assert wandb_records.config(files[0])["trainer"]["max_steps"] == 3
    assert wandb_records.config(files[1])["trainer"]["max_steps"] == 4
    assert wandb_records.config(files[1])["algorithm"]["group_size"] == 4

    # MLflow: one run in the experiment, each metric's history one value per step.
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("resume-test")
    (found,) = client.search_runs([experiment.experiment_id])
    assert (
        found.info.run_id
        == json.loads((run_dir / "trackers" / "mlflow.json").read_text())["run_id"]
    )
    assert found.info.run_name == "tracked-run"
    assert found.info.status == "FINISHED"
    for key, expected in (("reward/mean", reward), ("actor/kl", kl)):
        history = client.get_metric_history(found.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2, 3, 4], key
        assert {m.step: m.value for m in history} == expected, key
    # Parameters are the first run's (MLflow keeps them once); the artifact is the latest.
    assert found.data.params["trainer.max_steps"] == "3"
    assert found.data.params["algorithm.name"] == "grpo"
    workflow = client.download_artifacts(found.info.run_id, "posttrain/workflow.json", tmp_path)
    assert json.loads(Path(workflow).read_text())["trainer"]["max_steps"] == 4
