"""Modules next to the workflow file are importable, whatever the current directory, and
``posttrain validate`` finds (or misses) exactly what ``posttrain run`` would import: plugins,
reward functions, environment factories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from posttrain.cli import EXIT_OK, EXIT_USER, main

BESIDE = Path(__file__).resolve().parents[1] / "fixtures" / "beside_workflow"


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """A copy of the fixture's workflow and modules, with the current directory elsewhere."""
    workflow_dir = tmp_path / "workflow"
    shutil.copytree(BESIDE, workflow_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.syspath_prepend(str(tmp_path / "unrelated"))  # sys.path restored afterwards
    return str(workflow_dir / "workflow.yaml")


def test_modules_beside_the_workflow_validate(beside, capsys):
    for function in ("beside_reward:score", "beside_exact"):
        assert main(["validate", beside, "--set", f"reward.function={function}"]) == EXIT_OK
    assert "ok:" in capsys.readouterr().out


def test_validate_reports_what_run_could_not_import(beside, capsys):
    code = main(
        [
            "validate",
            beside,
            "--set",
            "reward.function=beside_rewrd:score",
            "--set",
            "environment.name=missing_factory",
            "--set",
            "plugins=[beside_plugin, beside_plugn]",
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert code == EXIT_USER
    assert "plugins[1]: plugin 'beside_plugn' is neither installed nor importable" in err
    assert "reward.function: module 'beside_rewrd' cannot be found" in err
    assert (
        "environment.name: environment 'missing_factory' has factory "
        "'beside_env_that_is_not_there:OneTurn', whose module 'beside_env_that_is_not_there' "
        "cannot be found"
    ) in err
    assert "put the module next to the workflow file or on PYTHONPATH" in err


def test_a_reward_name_nobody_registered_is_caught_by_validate(beside, capsys):
    assert main(["validate", beside, "--set", "reward.function=beside_exakt"]) == EXIT_USER
    err = " ".join(capsys.readouterr().err.split())
    assert "'beside_exakt' is neither a registered reward nor of the form" in err
    assert "did you mean 'beside_exact'?" in err
