"""Fixtures of more than one test folder: hf_infer's engine loaded in the test process, which
tests/hf_infer checks and tests/core drives (partial rollout, the episode runner, stop strings).

Every pytest run under tests/ loads this file, the vLLM and SGLang environments' too, so it
imports nothing heavy at module level: the engine comes in inside the fixtures. pytest puts
this folder on sys.path to import it, so the helper modules of several folders
(``tiny_models``) live here and are imported by name.
"""

from __future__ import annotations

import contextlib

import attrs
import pytest


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
    from posttrain_hf_infer.engine import HFInferState

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
