"""A learning-rate schedule left without a length follows the run: ``trainer.max_steps`` x the
updates of a step, resolved for the ranks (the run's record keeps it unset); one given a length
that is not the run's is a validation warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import EXIT_OK, main
from posttrain.host.plugin_host import create_plugin_host
from posttrain.launch.plan import group_spec
from posttrain.loading.workflow import load_workflow
from posttrain.training.lr_schedule import lr_lambda

REPO = Path(__file__).resolve().parents[2]
PPO = str(REPO / "examples" / "quickstart_ppo.yaml")

pytest.importorskip("posttrain_fsdp")  # the example's trained roles


def ranks_training_args(overrides: dict, role: str = "actor_train"):
    host = create_plugin_host()
    workflow, report = load_workflow(PPO, host, overrides)
    assert not report.errors, report.errors
    spec = group_spec(workflow, role, workflow.roles()[role], "/tmp/unused", "cpu")
    return workflow, report, spec.config.training_args


def test_the_ppo_examples_schedule_follows_trainer_max_steps():
    workflow, report, args = ranks_training_args({})
    assert workflow.actor_train.training_args.max_steps == -1  # the record keeps it unset
    assert args.max_steps == 400 * 2  # 400 steps, two mini-batches each
    assert report.warnings == []
    _, _, shorter = ranks_training_args({"trainer.max_steps": 100})
    assert shorter.max_steps == 200
    # Decayed to zero at the run's last update, whatever its length.
    assert lr_lambda(shorter)(200) == pytest.approx(0.0, abs=1e-12)
    assert lr_lambda(shorter)(100) > 0.4
    _, _, epochs = ranks_training_args({"trainer.max_steps": 100, "algorithm.ppo_epochs": 3})
    assert epochs.max_steps == 100 * 3 * 2
    _, _, critic = ranks_training_args({"trainer.max_steps": 100}, role="critic")
    assert critic.max_steps == 200


def test_a_schedule_of_another_length_is_kept_and_warned_about(capsys):
    overrides = {"trainer.max_steps": 100, "actor_train.training_args.max_steps": 800}
    _, report, args = ranks_training_args(overrides)
    assert args.max_steps == 800  # given: kept (the first steps of a longer run)
    [warning] = report.warnings
    assert warning.path == "actor_train.training_args.max_steps"
    assert "ends at optimizer step 800, the run at 200" in warning.message
    assert "follow trainer.max_steps" in warning.hint
    argv = ["validate", PPO, "--set", "trainer.max_steps=100"]
    assert main([*argv, "--set", "actor_train.training_args.max_steps=800"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "warning: actor_train.training_args.max_steps: 800: the cosine" in err, err
