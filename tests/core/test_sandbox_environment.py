"""The ``python_sandbox`` environment: its typed config, its tool in both call syntaxes on the
local sandbox, and ``posttrain sandbox run``'s user errors."""

from __future__ import annotations

import os

import pytest

from posttrain.cli import main
from posttrain.config.converter import structure_into
from posttrain.config.report import ErrorReport
from posttrain.rollout.environments.protocol import ModelTurn
from posttrain.rollout.environments.python_sandbox import (
    PythonSandboxConfig,
    observation,
    python_sandbox_environment,
)
from posttrain.sandbox import isolation as iso
from posttrain.sandbox.result import SandboxLimits, SandboxResult

# The environment's default isolation is bubblewrap; where it cannot run, the tests that run
# code use rlimits (asserting only what holds at both levels: the output).
LEVEL = iso.detect().best
needs_prlimit = pytest.mark.skipif(
    iso.detect().prlimit is None or not os.path.isfile("/usr/bin/python3"),
    reason="the local sandbox needs util-linux's prlimit and /usr/bin/python3",
)


def turn(text: str) -> ModelTurn:
    return ModelTurn(text=text, ids=(), index=0)


def test_config_errors_are_reported_at_once_with_their_paths():
    report = ErrorReport()
    raw = {"syntx": "compact", "limits": {"timeout_s": 0, "memory_mb": 1}, "backend": "cloud"}
    assert structure_into(raw, PythonSandboxConfig, "environment.kwargs", report) is None
    paths = {e.path for e in report.errors}
    assert paths == {
        "environment.kwargs.syntx",
        "environment.kwargs.limits.timeout_s",
        "environment.kwargs.limits.memory_mb",
        "environment.kwargs.backend",
    }, report.errors


def test_a_remote_backend_needs_its_url():
    report = ErrorReport()
    structure_into({"backend": "remote"}, PythonSandboxConfig, "environment.kwargs", report)
    [error] = report.errors
    assert error.path == "environment.kwargs" and "needs url" in error.message
    config = PythonSandboxConfig(backend="remote", url="http://127.0.0.1:1")
    assert config.limits == SandboxLimits()


def test_bubblewrap_isolation_is_refused_where_it_cannot_run():
    if iso.detect().bubblewrap:
        assert PythonSandboxConfig().isolation == "bubblewrap"
    else:
        with pytest.raises(ValueError, match="cannot run here"):
            PythonSandboxConfig()


@needs_prlimit
def test_an_interpreter_the_sandbox_user_cannot_reach_is_refused_at_validation(tmp_path):
    if iso.sandbox_user() is None:
        pytest.skip("the sandbox runs as the caller, who reaches its own files")
    hidden = tmp_path / "python3"  # pytest's folders let only their owner in
    hidden.symlink_to("/usr/bin/python3")
    report = ErrorReport()
    raw = {"python": str(hidden), "isolation": LEVEL, "read_only_paths": ["/nonexistent"]}
    structure_into(raw, PythonSandboxConfig, "environment.kwargs", report)
    [error] = report.errors
    assert error.path == "environment.kwargs"
    assert "runs as nobody, which cannot enter" in error.message
    assert "/nonexistent does not exist" in error.message


@needs_prlimit
def test_a_compact_call_runs_the_code_and_answers_its_output():
    env = python_sandbox_environment(PythonSandboxConfig(isolation=LEVEL))
    step = env.step(turn("<call>print(sum(range(1, 101)))</call>"))
    assert (step.observation, step.tool_calls, step.done) == ("<result>5050</result>", 1, False)
    step = env.step(turn("<call>1/0</call>"))
    assert step.observation.startswith("<result>Traceback") and "ZeroDivisionError" in (
        step.observation
    )
    final = env.step(turn("5050"))
    assert final.done and final.answer == "5050"


@needs_prlimit
def test_echo_last_expression_shows_a_bare_expressions_value_from_the_sandbox():
    # What the tiny vocabulary can write (digits and + - * =) is a program whose value is shown.
    env = python_sandbox_environment(
        PythonSandboxConfig(isolation=LEVEL, echo_last_expression=True)
    )
    step = env.step(turn("<call>12+345+67+89+10</call>"))
    assert (step.observation, step.tool_calls) == ("<result>523</result>", 1)
    # Off (the default), a script's bare expression prints nothing, as Python runs a file.
    plain = python_sandbox_environment(PythonSandboxConfig(isolation=LEVEL))
    assert plain.step(turn("<call>12+345</call>")).observation == "<result></result>"


@needs_prlimit
def test_a_hermes_call_and_the_observation_limit():
    config = PythonSandboxConfig(syntax="hermes", isolation=LEVEL, max_observation_chars=40)
    env = python_sandbox_environment(config)
    call = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    step = env.step(turn(call % "\"print('ab' * 500)\""))
    assert step.role == "tool" and step.tool_calls == 1
    assert len(step.observation) == 40 and step.observation.endswith("...[truncated]")
    refused = env.step(turn(call % '" "'))
    assert refused.observation == "error: no code to run" and refused.tool_calls == 0


def test_the_observation_says_which_limit_ended_the_program():
    killed = SandboxResult(
        stdout="1\n", stderr="MemoryError\n", exit_code=1, killed_reason="memory"
    )
    assert observation(killed, 100) == "1\nMemoryError\nstopped: memory limit"
    late = SandboxResult(
        stdout="", stderr="", exit_code=-9, timed_out=True, killed_reason="timeout"
    )
    assert observation(late, 100) == "timed out"


def test_sandbox_run_reports_every_bad_flag_and_a_missing_file(tmp_path, capsys):
    program = tmp_path / "p.py"
    program.write_text("print(1)\n")
    assert main(["sandbox", "run", str(program), "--timeout-s", "0", "--memory-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert "--timeout-s 0.0: out of range" in err and "--memory-mb 1: out of range" in err
    assert main(["sandbox", "run", str(tmp_path / "missing.py")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_doctor_reports_the_sandbox_guarantees_of_this_machine(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    main(["doctor"])
    out = capsys.readouterr().out
    found = iso.detect()
    rows = {
        cells[0]: cells[1]
        for line in out.splitlines()
        if line.startswith("│") and len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 3
    }
    assert rows["isolation"] == found.best
    for guarantee in found.guarantees(found.best):
        assert rows[guarantee.name] == ("yes" if guarantee.holds else "no"), guarantee
    if found.bubblewrap:
        assert rows["no network"] == rows["every process gone on return"] == "yes"


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """This machine as one without bwrap (CI installs it): what ``detect`` would find."""
    from posttrain.sandbox import local

    missing = iso.Isolation(
        bubblewrap=False, bubblewrap_problem=iso.NOT_INSTALLED, prlimit=iso.detect().prlimit
    )
    monkeypatch.setattr(iso, "detect", lambda: missing)
    local.warn_fallback_once.cache_clear()  # each test sees its own first warning
    yield
    local.warn_fallback_once.cache_clear()


def fallback_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "runs without bubblewrap" in line]


@needs_prlimit
def test_sandbox_run_auto_without_bubblewrap_warns_once_what_is_not_contained(
    no_bubblewrap, tmp_path, capsys
):
    program = tmp_path / "p.py"
    program.write_text("print(1)\n")
    assert main(["sandbox", "run", str(program)]) == 0
    out, err = capsys.readouterr()
    [line] = fallback_lines(err)
    assert line.startswith("warning: ") and "bwrap is not installed" in line
    for uncontained in ("network", "files", "processes"):
        assert uncontained in line, line
    assert "apt-get install bubblewrap" in line and "isolation: strict" in line
    assert '"isolation": "rlimits"' in out and '"stdout": "1\\n"' in out


def test_strict_isolation_without_bubblewrap_is_refused(no_bubblewrap, tmp_path, capsys):
    program = tmp_path / "p.py"
    program.write_text("open('ran', 'w')\n")
    assert main(["sandbox", "run", str(program), "--isolation", "strict"]) == 2
    out, err = capsys.readouterr()
    assert "error: isolation 'strict' needs bubblewrap, which cannot run here" in err, err
    assert "apt-get install bubblewrap" in err and out == ""
    with pytest.raises(ValueError, match="isolation 'strict' needs bubblewrap"):
        PythonSandboxConfig(isolation="strict")


def test_an_environment_on_auto_without_bubblewrap_warns_once_per_process(no_bubblewrap, capsys):
    # Made twice, as a run does (validation, then the instances): one line.
    PythonSandboxConfig(isolation="auto")
    PythonSandboxConfig(isolation="auto")
    [line] = fallback_lines(capsys.readouterr().err)
    assert "network" in line and "apt-get install bubblewrap" in line
    PythonSandboxConfig(isolation="rlimits")  # asked for by name: no warning
    assert fallback_lines(capsys.readouterr().err) == []


def test_auto_says_nothing_where_bubblewrap_runs():
    from posttrain.sandbox.local import fallback_warning

    assert fallback_warning("auto", "bubblewrap") == ""
    assert fallback_warning("rlimits", "rlimits") == ""
    assert fallback_warning("strict", "bubblewrap") == ""
