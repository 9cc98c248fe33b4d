"""The engine contract as protocols: every built-in plugin states its engine's kind in a line mypy
checks, the protocols and EngineHooks' forwarding list agree, and mypy fails an engine copy with
a required function deleted or re-signed."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.host.engine_hooks import ENGINE_FUNCTIONS
from posttrain.host.engine_protocols import Engine, RolloutEngine, TrainEngine

REPO = Path(__file__).resolve().parents[2]
PLUGINS = {
    REPO / "plugins/fsdp/posttrain_fsdp/plugin.py": "TrainEngine",
    REPO / "plugins/deepspeed/posttrain_deepspeed/plugin.py": "TrainEngine",
    REPO / "plugins/megatron/posttrain_megatron/plugin.py": "TrainEngine",
    REPO / "plugins/vllm/posttrain_vllm/plugin.py": "RolloutEngine",
    REPO / "plugins/sglang/posttrain_sglang/plugin.py": "RolloutEngine",
    REPO / "plugins/hf_infer/posttrain_hf_infer/plugin.py": "RolloutEngine",
}


def members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_protocols_list_only_functions_engine_hooks_forwards():
    required = members(Engine) | members(TrainEngine) | members(RolloutEngine)
    assert required <= set(ENGINE_FUNCTIONS), sorted(required - set(ENGINE_FUNCTIONS))
    assert Engine in TrainEngine.__mro__ and Engine in RolloutEngine.__mro__


def declared_engine_kind(plugin: Path) -> str | None:
    """The protocol of the plugin's ``_ENGINE: Protocol = engine`` line (under TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(plugin.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "_ENGINE"
            and isinstance(node.value, ast.Name)
            and node.value.id == "engine"
        ):
            return ast.unparse(node.annotation)
    return None


@pytest.mark.parametrize("plugin", sorted(PLUGINS), ids=lambda p: p.parent.name)
def test_every_plugin_states_its_engine_kind_for_mypy(plugin):
    assert declared_engine_kind(plugin) == PLUGINS[plugin]


def mypy(paths: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    """mypy with the repository's settings on ``paths``; core from this checkout (an editable
    install is invisible to mypy, and a missing ``posttrain`` would make the protocols Any)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(REPO / "pyproject.toml"),
            "--cache-dir",
            str(cwd / ".mypy_cache"),
            *map(str, paths),
        ],
        cwd=cwd,
        env={**os.environ, "MYPYPATH": str(REPO / "core")},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_mypy_fails_an_engine_missing_a_function_or_with_another_signature(tmp_path):
    pytest.importorskip("mypy")
    package = tmp_path / "posttrain_fsdp"
    shutil.copytree(REPO / "plugins/fsdp/posttrain_fsdp", package)
    engine = package / "engine.py"
    source = engine.read_text(encoding="utf-8")
    files = [package / "plugin.py", engine]
    intact = mypy(files, tmp_path)
    assert intact.returncode == 0, intact.stdout

    engine.write_text(source.replace("\ndef train_step(", "\ndef _train_step("), encoding="utf-8")
    missing = mypy(files, tmp_path)
    assert missing.returncode == 1
    assert '"TrainEngine" protocol member' in missing.stdout and "train_step" in missing.stdout

    resigned = source.replace(
        "def load_checkpoint(worker: WorkerContext, path: str) -> bool:",
        "def load_checkpoint(worker: WorkerContext, path: str, strict: bool) -> bool:",
    )
    assert resigned != source
    engine.write_text(resigned, encoding="utf-8")
    changed = mypy(files, tmp_path)
    assert changed.returncode == 1
    assert "load_checkpoint" in changed.stdout


def test_engine_state_is_one_typed_object_per_role_and_class():
    import attrs

    from posttrain import WorkerContext
    from posttrain.config.sections import ModelArgs

    @attrs.define
    class Counter:
        steps: int = 0

    def context(role: str) -> WorkerContext:
        return WorkerContext(
            role=role, strategy_name="x", config=None, model_args=ModelArgs(model_name_or_path="m")
        )

    actor, critic = context("actor_train"), context("critic")
    actor.engine_state(Counter).steps += 2
    assert actor.engine_state(Counter).steps == 2
    assert actor.engine_state(Counter) is actor.engine_state(Counter)
    assert critic.engine_state(Counter).steps == 0
