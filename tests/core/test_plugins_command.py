"""``posttrain plugins``: ``--config NAME`` prints a strategy's ``strategy_config`` keys (built-in
and third-party alike), and the hook listing names only the worker hooks an ``EngineHooks``
plugin's engine module defines. No worker processes: the plugins are only declared and listed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from posttrain.cli import EXIT_OK, EXIT_USER, main

FSDP_MISSING = importlib.util.find_spec("posttrain_fsdp") is None

# A third-party plugin (an EngineHooks subclass) whose engine module defines three of the worker
# hooks' functions and cannot be imported at all: the listing must read it, never import it.
KEYS_PLUGIN = '''\
from __future__ import annotations

import attrs

from posttrain import Capabilities, EngineHooks, ScoringOptions, StrategySpec, hookimpl


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How the engine retries a failed request."""

    # Attempts before the request fails.
    attempts: int = 3
    backoff_s: float = 0.5  # seconds between attempts


@attrs.frozen(kw_only=True)
class ContractKeysConfig(ScoringOptions):
    """``strategy_config`` of ``contract_keys_strategy``."""

    # Where the engine listens.
    endpoint: str
    retry: RetryPolicy = RetryPolicy()


class ContractKeysPlugin(EngineHooks):
    strategies = ("contract_keys_strategy",)
    engine = "contract_keys_engine"

    @hookimpl
    def posttrain_add_strategies(self):
        return [
            StrategySpec(
                name="contract_keys_strategy",
                config_class=ContractKeysConfig,
                capabilities=Capabilities(kind="rollout"),
            )
        ]

    @hookimpl
    def posttrain_shutdown_worker(self, worker):  # its own, not the engine's
        return True


plugin = ContractKeysPlugin()
'''

KEYS_ENGINE = """\
raise RuntimeError("posttrain plugins must not import an engine module")


def setup_parallel(worker):
    return {"dp_rank": 0, "dp_size": 1}


def load_model(worker):
    return None


def generate(worker, request):
    return []
"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """Two installed entry points of one distribution: ``contract_export`` (the module
    ``export_source_plugin`` of tests/core) and ``contract_keys`` (:data:`KEYS_PLUGIN`)."""
    (tmp_path / "contract_keys_plugin.py").write_text(KEYS_PLUGIN)
    (tmp_path / "contract_keys_engine.py").write_text(KEYS_ENGINE)
    dist_info = tmp_path / "posttrain_contract_keys-0.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Name: posttrain-contract-keys\nVersion: 0.2\n")
    (dist_info / "entry_points.txt").write_text(
        "[posttrain]\ncontract_export = export_source_plugin\n"
        "contract_keys = contract_keys_plugin:plugin\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer,posttrain-contract-keys")
    monkeypatch.setenv("COLUMNS", "100")


@pytest.mark.skipif(FSDP_MISSING, reason="posttrain-fsdp is not installed")
def test_config_of_a_builtin_strategy_with_inherited_keys(capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLUGINS", "fsdp")
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["plugins", "--config", "fsdp2_train"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("fsdp2_train: strategy_config keys (")
    # Inherited from posttrain.ScoringOptions, with its range, default and comment.
    assert "\n  logprob_chunk_tokens: integer, >= 1, or 0 (off: full logits); default 1024\n" in out
    doc = out.split("logprob_chunk_tokens:", 1)[1].split("\n\n", 1)[0]
    assert "Log-probs from the output head this many tokens at a time" in " ".join(doc.split())
    assert '\n  param_offload: one of: true, false, auto; default "auto"\n' in out

    assert main(["plugins", "--config", "fsdp2_train", "--json"]) == EXIT_OK
    described = json.loads(capsys.readouterr().out)
    assert described["strategy"] == "fsdp2_train" and described["plugin"] == "fsdp"
    keys = {key["key"]: key for key in described["keys"]}
    chunk = keys["logprob_chunk_tokens"]
    assert [chunk["type"], chunk["default"], chunk["keys"]] == [
        "integer, >= 1, or 0 (off: full logits)",
        "1024",
        [],
    ]
    assert chunk["doc"].startswith("Log-probs from the output head")
    assert list(keys)[:3] == ["micro_batch_size", "logprob_micro_batch_size", chunk["key"]]


@pytest.mark.skipif(FSDP_MISSING, reason="posttrain-fsdp is not installed")
def test_config_imports_no_torch():
    code = (
        "import sys\nfrom posttrain.cli import main\n"
        "rc = main(['plugins', '--config', 'fsdp2_train'])\n"
        "print('RESULT', rc, 'torch' in sys.modules)"
    )
    env = {**os.environ, "POSTTRAIN_PLUGINS": "fsdp"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert "logprob_chunk_tokens" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 0 False", proc.stdout + proc.stderr


def test_config_of_a_third_party_strategy(third_party, capsys):
    assert main(["plugins", "--config", "contract_fake_export"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "(export_source_plugin.ContractFakeExportConfig, plugin contract_export)" in out
    assert "\n  seed: integer; default 7\n" in out
    assert "\n  scale: number; default 0.05\n" in out

    assert main(["plugins", "--config", "contract_keys_strategy"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "  `strategy_config` of `contract_keys_strategy`." in out
    assert "\n  endpoint: string; required\n      Where the engine listens.\n" in out
    assert "\n  logprob_chunk_tokens: integer" in out  # inherited
    # The nested class's keys under its key, with their comments.
    retry = out.split("\n  retry: RetryPolicy; defaults of each key\n", 1)[1]
    assert retry.startswith("      How the engine retries a failed request.\n")
    assert (
        "\n      attempts: integer; default 3\n          Attempts before the request fails."
        in retry
    )
    assert "\n      backoff_s: number; default 0.5\n          seconds between attempts" in retry
    assert "contract_keys_engine" not in sys.modules

    assert main(["plugins", "--config", "contract_keys_strategy", "--json"]) == EXIT_OK
    keys = {k["key"]: k for k in json.loads(capsys.readouterr().out)["keys"]}
    assert [k["key"] for k in keys["retry"]["keys"]] == ["attempts", "backoff_s"]
    assert keys["endpoint"]["default"] == "required"


def test_config_of_an_unknown_strategy_is_a_user_error(third_party, capsys):
    assert main(["plugins", "--config", "contract_keys_strategie"]) == EXIT_USER
    err = " ".join(capsys.readouterr().err.split())
    assert "error: --config contract_keys_strategie: no installed plugin declares this" in err
    assert "did you mean 'contract_keys_strategy'?" in err
    assert "installed strategies: contract_fake_export, contract_keys_strategy, hf_infer" in err
    assert "Traceback" not in err


def test_listing_names_only_the_hooks_the_engine_defines(third_party, capsys):
    assert main(["plugins", "--json"]) == EXIT_OK
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    keys = plugins["contract_keys"]
    assert keys["hooks"] == [
        "posttrain_add_strategies",
        "posttrain_generate",
        "posttrain_load_model",
        "posttrain_setup_parallel",
        "posttrain_shutdown_worker",  # the plugin's own implementation
    ]
    assert "posttrain_train_step" in keys["engine_lacks"]
    assert "posttrain_shutdown_worker" not in keys["engine_lacks"]
    assert plugins["contract_export"]["engine_lacks"] == []  # not an EngineHooks plugin

    assert main(["plugins"]) == EXIT_OK
    out = capsys.readouterr().out
    block = next(b for b in out.split("\n\n") if b.startswith("contract_keys ("))
    hooks, lacks = block.split("hooks:", 1)[1].split("engine lacks:")
    assert hooks.replace(",", " ").split() == [
        "add_strategies",
        "generate",
        "load_model",
        "setup_parallel",
        "shutdown_worker",
    ]
    assert "train_step" in lacks.replace(",", " ").split()
    assert "contract_keys_engine" not in sys.modules


def test_listing_of_an_engine_whose_source_cannot_be_read(third_party, tmp_path, capsys):
    (tmp_path / "contract_keys_engine.py").write_text("from os.path import *\n")
    assert main(["plugins", "--json"]) == EXIT_OK
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["contract_keys"]["engine_lacks"] is None
    assert "posttrain_train_step" in plugins["contract_keys"]["hooks"]  # cannot tell: listed
    assert main(["plugins"]) == EXIT_OK
    assert "engine lacks: unknown (its source cannot be read)" in capsys.readouterr().out
