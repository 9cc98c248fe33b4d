"""A plugin whose entry-point module raises at import is reported by name with its error, and
every other plugin keeps working."""

from __future__ import annotations

import json

import pytest
from plugin_venv import REPO, build_plugin_venv, run_in_venv

BROKEN = REPO / "tests" / "fixtures" / "broken_plugin"
ERROR = "RuntimeError: boom: deliberately broken"


@pytest.fixture(scope="module")
def broken_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken_plugin")
    return build_plugin_venv(root, BROKEN), root / "work"


CHECK_HOST = r"""
import json
from posttrain.host.plugin_host import create_plugin_host

host = create_plugin_host()
print(json.dumps({
    "failures": [[p.name, p.source, p.distribution, p.error] for p in host.failures],
    "loaded": [p.name for p in host.plugins if not p.error],
    "strategies": sorted(host.strategies()),
    "hf_infer_plugin": host.strategies()["hf_infer"].plugin,
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plugins_command_names_the_broken_plugin(broken_venv):
    python, work = broken_venv
    proc = run_in_venv(python, ["-m", "posttrain.cli", "plugins"], work)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "broken" in proc.stdout
    assert "failed to load" in proc.stdout
    assert ERROR in proc.stdout
    assert "Traceback" not in output
    # The other plugins still load and answer.
    assert "hf_infer" in proc.stdout
    assert "posttrain.rewards.builtin" in proc.stdout
    # Every command warns about it on stderr.
    assert "plugin 'broken' failed to load" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plugin_host_records_failure_and_keeps_others(broken_venv):
    python, work = broken_venv
    proc = run_in_venv(python, ["-c", CHECK_HOST], work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures"] == [["broken", "entry point", "posttrain-broken-plugin", ERROR]]
    assert "broken" not in out["loaded"]
    assert "hf_infer" in out["strategies"]
    assert out["hf_infer_plugin"] == "hf_infer"  # its entry point


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_broken_plugin_can_be_switched_off(broken_venv):
    python, work = broken_venv
    for env in ({"POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"POSTTRAIN_PLUGINS": "other"}):
        proc = run_in_venv(python, ["-m", "posttrain.cli", "plugins"], work, **env)
        assert proc.returncode == 0, (env, proc.stdout + proc.stderr)
        assert "broken" not in proc.stdout + proc.stderr
        assert "posttrain.rewards.builtin" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workflow_naming_the_broken_plugin_is_a_validation_error(broken_venv):
    python, work = broken_venv
    workflow = work / "uses_broken.yaml"
    workflow.write_text("plugins: [broken]\n", encoding="utf-8")
    proc = run_in_venv(python, ["-m", "posttrain.cli", "validate", str(workflow)], work)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "plugins[0]" in output
    assert "plugin 'broken' failed to import" in output
    assert "boom: deliberately broken" in output
    assert "Traceback" not in output
