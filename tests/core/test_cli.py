"""The `posttrain` command line: validate (errors, exit code, speed, no torch), plugins, doctor."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

from posttrain.cli import EXIT_OK, EXIT_USER, main

BAD_WORKFLOW = """\
model_args: {{model_name_or_path: {model}}}
data: {{synthetic: {{task: single_digit_addition}}}}
algorithm: {{name: grpo, group_size: 2, rollout_batch_size: 4}}
actor_train:
  strategy_args:
    strategy_name: megatron_train
    strategy_config: {{tensor_model_parallel_size: 1}}
  device_mapping: list(range(0, 2))
actor_infer:
  strategy_args:
    strategy_name: hf_infer
    strategy_config: {{batch_sise: 4}}
  device_mapping: [0]
trainer: {{max_steps: ten, max_step: 3}}
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("POSTTRAIN_PLUGINS", None)
    env.update(COLUMNS="400", **extra)
    return env


@pytest.fixture
def bad_workflow(write_workflow, model_dir):
    return write_workflow(BAD_WORKFLOW.format(model=model_dir))


def test_validate_reports_every_error_with_paths_and_hints(bad_workflow):
    # Autoload off: megatron_train is surely not provided, whatever is installed here.
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "validate", bad_workflow],
        capture_output=True,
        text=True,
        env=_env(POSTTRAIN_PLUGINS="hf_infer"),
        timeout=60,
    )
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_USER, out
    assert "Traceback" not in out
    assert f"{bad_workflow}: 4 error(s)" in out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("- ")]
    assert lines == [
        "- trainer.max_steps: expected an integer, got str 'ten'",
        "- trainer.max_step: unknown key (did you mean 'max_steps'?)",
        "- actor_train.strategy_args.strategy_name: unknown strategy 'megatron_train' "
        "('megatron_train' is provided by posttrain-megatron (pip install ./plugins/megatron); "
        "installed strategies: hf_infer)",
        "- actor_infer.strategy_args.strategy_config.batch_sise: unknown key "
        "(did you mean 'batch_size'?)",
    ]
    assert wall < 30.0, f"the whole validate subprocess took {wall:.2f} s"


def test_validate_is_fast_and_imports_no_torch(bad_workflow):
    """Measured inside the subprocess (no interpreter start-up), with every installed plugin, in
    CPU seconds: what validate costs, whatever else loads the machine (CI runs suites side by
    side). Importing torch alone costs more than the bound."""
    code = textwrap.dedent(
        """\
        import sys, time
        start = time.process_time()
        from posttrain.cli import main
        rc = main(["validate", sys.argv[1]])
        elapsed = time.process_time() - start
        heavy = sorted(m for m in ("torch", "transformers", "vllm", "sglang", "megatron")
                       if m in sys.modules)
        print(f"RESULT rc={rc} elapsed={elapsed:.4f} heavy={','.join(heavy) or '-'}")
        """
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, bad_workflow],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    wall = time.perf_counter() - start
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, proc.stdout + proc.stderr
    fields = dict(item.split("=", 1) for item in result[0].split()[1:])
    assert fields["rc"] == str(EXIT_USER)
    assert fields["heavy"] == "-", f"validate imported {fields['heavy']}"
    assert float(fields["elapsed"]) < 1.0, f"validate took {fields['elapsed']} CPU s in-process"
    assert wall < 30.0, f"the whole subprocess took {wall:.2f} s"


def test_validate_ok_exits_zero(write_workflow, model_dir, capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    monkeypatch.setenv("COLUMNS", "400")
    path = write_workflow(
        f"""\
        model_args: {{model_name_or_path: {model_dir}}}
        data: {{synthetic: {{}}}}
        algorithm: {{name: grpo, group_size: 2, rollout_batch_size: 4}}
        plugins: [export_source_plugin]
        actor_train:
          strategy_args: {{strategy_name: contract_fake_export}}
          device_mapping: [0, 1]
        actor_infer:
          strategy_args: {{strategy_name: hf_infer}}
          device_mapping: list(range(2))
        """
    )
    assert main(["validate", path]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"ok: {path} (actor_train=contract_fake_export[2], actor_infer=hf_infer[2])" in out


def test_validate_set_override(write_workflow, model_dir, capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    path = write_workflow(BAD_WORKFLOW.format(model=model_dir))
    code = main(["validate", path, "--set", "trainer.max_steps=5", "--set", "trainer.max_step=~"])
    err = capsys.readouterr().err
    assert code == EXIT_USER
    assert "trainer.max_steps" not in err
    assert "3 error(s)" in err


def test_missing_workflow_file_is_a_user_error(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == EXIT_USER
    err = capsys.readouterr().err
    assert "workflow file not found" in err
    assert "Traceback" not in err


def test_bad_set_syntax_is_a_user_error(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "w.yaml"), "--set", "novalue"]) == EXIT_USER
    assert "expected KEY=VALUE" in capsys.readouterr().err


def _plugin_blocks(out: str) -> dict[str, str]:
    """``posttrain plugins`` output: plugin name -> its block (header and indented lines)."""
    blocks = [block for block in out.split("\n\n") if block.strip()]
    return {block.split(" (", 1)[0]: block for block in blocks}


def test_plugins_fits_80_columns_and_names_every_hook_in_full(capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    monkeypatch.setenv("COLUMNS", "80")  # what a pipe gets, and a narrow terminal
    assert main(["plugins"]) == EXIT_OK
    out = capsys.readouterr().out
    from posttrain.host.plugin_host import BUILTIN_PLUGINS, create_plugin_host

    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "…" not in out
    blocks = _plugin_blocks(out)
    host = create_plugin_host()
    for name in (entry.partition(":")[0] for entry in BUILTIN_PLUGINS):
        assert f"{name} (builtin; posttrain " in blocks[name], out
        # The hook list may wrap, never between the letters of a name.
        listed = blocks[name].split("hooks:", 1)[1].replace(",", " ").split()
        assert listed == [h.removeprefix("posttrain_") for h in host.hooks_of(name)]
    assert "strategies: hf_infer" in blocks["hf_infer"]


def test_plugins_json_lists_everything_for_scripts(capsys, monkeypatch):
    import json

    from posttrain import __version__

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    assert main(["plugins", "--json"]) == EXIT_OK
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    hf = plugins["hf_infer"]  # a plugin like the others, found through its entry point
    assert [hf["source"], hf["distribution"], hf["version"]] == [
        "entry point",
        "posttrain-hf-infer",
        __version__,
    ]
    assert hf["strategies"] == ["hf_infer"]
    assert "posttrain_generate" in hf["hooks"] and hf["error"] is None
    assert plugins["posttrain.rewards.builtin"]["strategies"] == []


def test_plugins_with_installed_entry_points_imports_no_torch():
    code = (
        "import sys\nfrom posttrain.cli import main\nrc = main(['plugins'])\n"
        "print('RESULT', rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "hf_infer" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 0 False", proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_doctor_lists_torch_ok(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    main(["doctor"])
    out = capsys.readouterr().out
    torch_rows = [line for line in out.splitlines() if "│ torch " in line]
    assert len(torch_rows) == 1, out
    cells = [c.strip() for c in torch_rows[0].split("│")[1:-1]]
    plugin, package, installed, _tested, status = cells
    assert (plugin, package, status) == ("posttrain", "torch", "ok")
    assert installed == importlib.metadata.version("torch")  # read from metadata, not imported


def test_doctor_piped_cuts_no_name(capsys, monkeypatch):
    """A pipe is not a terminal: rich would take 80 columns and cut names with "…"."""
    from posttrain import hookimpl
    from posttrain.host.doctor import EnvCheck
    from posttrain.host.plugin_host import create_plugin_host

    monkeypatch.delenv("COLUMNS", raising=False)
    long_name = "posttrain-a-plugin-with-a-name-longer-than-a-column-of-80"

    class LongNames:
        @hookimpl
        def posttrain_environment_checks(self):
            package = "a-package-name-as-long-as-" + "x" * 20
            return [EnvCheck(plugin=long_name, package=package, tested=">=1")]

    host = create_plugin_host(extra_plugins=[LongNames()])
    monkeypatch.setattr("posttrain.host.plugin_host.create_plugin_host", lambda: host)
    main(["doctor"])
    out = capsys.readouterr().out
    assert "…" not in out, out
    [row] = [line for line in out.splitlines() if long_name in line]
    assert "a-package-name-as-long-as-" + "x" * 20 in row
    # The sandbox table's explanations stay whole too: one row, one line.
    assert any("│ CPU-time limit " in line and "RLIMIT_CPU" in line for line in out.splitlines())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_preset_build_and_model_load_draw_no_progress_bars(tmp_path, monkeypatch, capfd):
    """transformers' "Writing model shards" / "Loading weights" bars printed at a run's start
    (the driver builds the preset) and filled the rank logs."""
    from transformers.utils import logging as hf_logging

    from posttrain.backends.models import load_causal_lm
    from posttrain.config.sections import ModelArgs
    from posttrain.tasks.presets import preset_path

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    bars_were_on = hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    load_causal_lm(ModelArgs(model_name_or_path=preset_path("preset:tiny-qwen2")))
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err, err
    assert hf_logging.is_progress_bar_enabled() == bars_were_on  # restored for other callers


def test_paths_print_resolved(tmp_path, monkeypatch, capsys):
    from posttrain.paths import display_path

    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "examples" / ".." / "runs" / "quickstart") == "runs/quickstart"
    assert display_path("runs//a/./b") == "runs/a/b"
    assert display_path(tmp_path) == "."
    assert display_path("../elsewhere") == str(tmp_path.parent / "elsewhere")  # not under cwd
    # Through validate: the workflow's own relative paths resolve against its directory.
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "w.yaml").write_text("data: {path: ../data/missing.jsonl}\n")
    assert main(["validate", "examples/../examples/w.yaml"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "examples/w.yaml: " in err and "/../" not in err, err
    assert "data.path: file not found: data/missing.jsonl" in err, err


def test_set_paths_resolve_against_the_current_directory(tmp_path, monkeypatch, capsys):
    """The file's own paths resolve against its directory; a path typed with --set against the
    directory it was typed in (README: ``--set trainer.output_dir=runs/quickstart_async`` from
    the repository's root)."""
    from posttrain.cli import _parse_overrides

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    overrides = _parse_overrides(
        [
            "trainer.output_dir=runs/a",
            "trainer.resume=auto",
            "data.path=data/x.jsonl",
            "actor_train.model_args.model_name_or_path=model",
            "model_args.model_name_or_path=Qwen/Qwen2.5-0.5B",  # a hub id: no such directory
            "algorithm.name=grpo",
            "trainer.max_steps=5",
            "actor_train.training_args.learning_rate=1e-3",  # a number, as in the file
            "reward.kwargs.lower=-",
        ]
    )
    assert overrides == {
        "trainer.output_dir": str(tmp_path / "runs" / "a"),
        "trainer.resume": "auto",
        "data.path": str(tmp_path / "data" / "x.jsonl"),
        "actor_train.model_args.model_name_or_path": str(tmp_path / "model"),
        "model_args.model_name_or_path": "Qwen/Qwen2.5-0.5B",
        "algorithm.name": "grpo",
        "trainer.max_steps": 5,
        "actor_train.training_args.learning_rate": 1e-3,
        "reward.kwargs.lower": [None],  # YAML: a "-" alone is a list of one empty item
    }
    assert main(["validate", "w.yaml", "--set", "a=[1,"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "quote it" in err and "Traceback" not in err


def test_run_help_explains_paths_and_yaml_values(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "parsed as YAML" in text
    assert "resolve against the file's directory" in text
    assert "resolves against the current directory" in text


def test_plugins_list_what_each_plugin_adds_by_kind(capsys, monkeypatch):
    import json

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    assert main(["plugins", "--json"]) == EXIT_OK
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    algorithms = plugins["posttrain.algorithms.builtin"]
    assert algorithms["algorithms"] == ["grpo", "gspo", "ppo", "reinforce_plus_plus", "rloo"]
    assert algorithms["advantage_estimators"] == ["gae", "grpo", "reinforce_plus_plus", "rloo"]
    assert algorithms["policy_losses"] == ["gspo", "ppo"]
    assert plugins["posttrain.rewards.builtin"]["reward_functions"] == [
        "exact_match",
        "numeric_match",
    ]
    assert plugins["posttrain.rollout.environments.builtin"]["environments"] == [
        "calculator",
        "python_sandbox",
    ]
    transports = plugins["posttrain.weight_sync.builtin"]["weight_transports"]
    assert transports == ["broadcast", "in_process", "shared_memory"]
    assert plugins["posttrain.loading.checks"]["commands"] == []
    assert main(["plugins"]) == EXIT_OK
    blocks = _plugin_blocks(capsys.readouterr().out)
    assert "environments: calculator" in blocks["posttrain.rollout.environments.builtin"]
    assert "policy losses: gspo, ppo" in blocks["posttrain.algorithms.builtin"]


def test_sigterm_and_an_inherited_ignored_sigint_stop_a_command_as_ctrl_c_does():
    """What a scheduler sends, and what ``cmd &`` from a script leaves ignored: posttrain
    installs both handlers itself (tests/e2e/test_signals.py stops a real run)."""
    import signal

    from posttrain.cli import _stop_on_signals

    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _stop_on_signals()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(sig)
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
