"""Shared fixtures of the core tests. Keep each fixture small; other test files add their own."""

from __future__ import annotations

import contextlib
import json
import textwrap

import attrs
import pytest

from posttrain import ScoringOptions, hookimpl
from posttrain.host.strategy import Capabilities, StrategySpec
from posttrain_hf_infer.engine import HFInferState

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


def load_hf_infer_worker(model_path: str, device: str = "cpu", dtype: str = "fp32", **config):
    """hf_infer's engine on ``model_path`` in ``dtype`` (``model_args.dtype``), ``config`` its
    ``strategy_config``."""
    from posttrain.config.sections import ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.plugin import HFInferConfig

    worker = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=HFInferConfig(**config),
        model_args=ModelArgs(model_name_or_path=model_path, dtype=dtype),
        device=device,
    )
    worker.model = hf_infer.load_model(worker)
    return worker


@pytest.fixture(scope="session")
def hf_infer_loader():
    """:func:`load_hf_infer_worker`, for tests that load the engine on a model of their own."""
    return load_hf_infer_worker


def settings_of(worker):
    """A context manager over ``worker``: it applies ``changes`` to the worker's strategy
    config (a test may change it further inside), yields the worker, and on the way out puts
    the config back and drops the decoders kept for the changed settings, so the tests that
    follow find the engine as loaded."""

    @contextlib.contextmanager
    def settings(**changes):
        original = worker.config
        worker.config = attrs.evolve(original, **changes)
        try:
            yield worker
        finally:
            worker.config = original
            worker.engine_state(HFInferState).decoders = None

    return settings


@pytest.fixture(scope="session")
def hf_infer_worker(tiny_model_path):
    """hf_infer's rollout engine on preset:tiny-qwen2, loaded in this process once: for tests
    that call the engine's functions directly."""
    return load_hf_infer_worker(tiny_model_path)


@pytest.fixture(scope="session")
def hf_infer_settings(hf_infer_worker):
    """:func:`settings_of` the session's hf_infer engine. Session-scoped, for module-scoped
    fixtures too."""
    return settings_of(hf_infer_worker)


@pytest.fixture(scope="session")
def hf_infer_cuda_settings(tiny_model_path):
    """:func:`settings_of` the same engine on a CUDA GPU (for tests marked ``gpu``)."""
    return settings_of(load_hf_infer_worker(tiny_model_path, "cuda"))
