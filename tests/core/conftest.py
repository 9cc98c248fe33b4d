"""Shared fixtures of the core tests. Keep each fixture small; other test files add their own.
hf_infer's engine in the test process (``hf_infer_worker``, ...) is tests/conftest.py's: the
hf_infer tests take it too."""

from __future__ import annotations

import json
import textwrap

import attrs
import pytest

from posttrain import ScoringOptions, hookimpl
from posttrain.host.strategy import Capabilities, StrategySpec

CONTRACT_FAKE_TRAIN = "contract_fake_train"


@attrs.frozen(kw_only=True)
class ContractFakeTrainConfig(ScoringOptions):
    """``strategy_config`` of the fake train strategy: one parallel dim, like Megatron's TP, and
    the shared scoring options (one row per forward pass)."""

    tensor_model_parallel_size: int = 1
    micro_batch_size: int | None = 1


class ContractFakeTrainPlugin:
    """A FAKE 'train' strategy for core contract tests only: it declares a strategy and nothing
    else (no engine), so the core's validation can be tested with no backend installed."""

    @hookimpl
    def posttrain_add_strategies(self):
        return [
            StrategySpec(
                name=CONTRACT_FAKE_TRAIN,
                config_class=ContractFakeTrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    parallel_dims=("tensor_model_parallel_size",),
                    exports_hf_weights=True,
                    heads=("lm", "value"),
                ),
                description="fake train strategy for core contract tests",
            )
        ]


@pytest.fixture
def contract_fake_train_plugin():
    """An instance of :class:`ContractFakeTrainPlugin` (strategy ``contract_fake_train``).

    Tests take it through this fixture: ``from conftest import ...`` is fragile once several
    test folders have a conftest.py."""
    return ContractFakeTrainPlugin()


@pytest.fixture
def fake_train_host(monkeypatch, contract_fake_train_plugin):
    """A plugin host with built-ins, hf_infer and the fake train strategy; no other entry point is
    loaded, so the result does not depend on which plugins happen to be installed."""
    from posttrain.host.plugin_host import create_plugin_host

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    return create_plugin_host(extra_plugins=[contract_fake_train_plugin])


@pytest.fixture
def model_dir(tmp_path):
    """A local "HF model directory": only a config.json, which is all validation looks at."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return path


@pytest.fixture
def write_workflow(tmp_path):
    """Write dedented YAML text to a file in tmp_path; returns its path as a string."""

    def write(text: str, name: str = "workflow.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write
