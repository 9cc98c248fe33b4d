"""A checkpoint's workflow record: what a resume may change (where and how long it runs) and
what makes it another run (everything that defines the training)."""

from __future__ import annotations

import attrs
import yaml

from posttrain.checkpoint.record import run_changes, workflow_record
from posttrain.config.report import ErrorReport
from posttrain.loading.workflow import load_workflow

QUICKSTART = "examples/quickstart.yaml"


def _quickstart(host, **overrides):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / QUICKSTART
    workflow, report = load_workflow(str(path), host, overrides, ErrorReport())
    assert not report.errors, report.errors
    return workflow


def test_a_record_round_trips_and_neutral_changes_are_not_changes():
    from posttrain.host.plugin_host import create_plugin_host

    host = create_plugin_host()  # the quickstart names fsdp2_train
    saved = yaml.safe_load(workflow_record(_quickstart(host), "q.yaml"))
    assert saved["run"]["source"] == "q.yaml"
    assert run_changes(saved["workflow"], _quickstart(host)) == []
    neutral = _quickstart(
        host,
        **{
            "trainer.max_steps": 800,
            "trainer.save_steps": 7,
            "trainer.logger": ["console"],
            "trainer.output_dir": "/elsewhere",
            "cluster.launcher": "ray",
            "cluster.call_timeout_s": 60.0,
            # evaluation only reads the policy: a resume (or posttrain eval) may change it
            "evaluation.every_steps": 10,
            "evaluation.max_prompts": 5,
        },
    )
    assert run_changes(saved["workflow"], neutral) == []


def test_changes_that_define_another_run_are_listed_by_path():
    from posttrain.host.plugin_host import create_plugin_host

    host = create_plugin_host()
    saved = yaml.safe_load(workflow_record(_quickstart(host), "q.yaml"))["workflow"]
    changed = _quickstart(
        host,
        **{
            "algorithm.max_staleness": 1,
            "algorithm.tis_cap": 2.0,
            "actor_train.device_mapping": [0],
            "reference.device_mapping": [0],
            "actor_infer.device_mapping": [1],
            "actor_train.training_args.learning_rate": 1e-4,
            "trainer.seed": 7,
        },
    )
    assert run_changes(saved, changed) == [
        "actor_infer.device_mapping: [0, 1] -> [1]",
        "actor_train.device_mapping: [0, 1] -> [0]",
        "actor_train.training_args.learning_rate: 0.001 -> 0.0001",
        "algorithm.max_staleness: 0 -> 1",
        "algorithm.tis_cap: null -> 2.0",
        "reference.device_mapping: [0, 1] -> [0]",
        "trainer.seed: 42 -> 7",
    ]
    # Strategy configs are recorded as the strategy typed them, every field with its value.
    config = changed.actor_train.strategy_args.strategy_config
    recorded = saved["actor_train"]["strategy_args"]["strategy_config"]
    assert recorded == yaml.safe_load(yaml.safe_dump(attrs.asdict(config)))
