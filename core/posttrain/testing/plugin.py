"""pytest plugin of the conformance kit: shared fixtures (a tiny model built once per session)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: posttrain strategy contract test")
    # A test session starts many groups of every engine: the CPU fork server its local ranks
    # come from imports every installed engine's library once (EngineHooks.preload).
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.launch.local import preload_in_fork_server

    preload_in_fork_server(create_plugin_host().fork_preload())


@pytest.fixture(scope="session")
def posttrain_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A session-wide preset cache, unless the user points POSTTRAIN_CACHE somewhere."""
    if os.environ.get("POSTTRAIN_CACHE"):
        return os.environ["POSTTRAIN_CACHE"]
    path = str(tmp_path_factory.mktemp("posttrain-cache"))
    os.environ["POSTTRAIN_CACHE"] = path  # inherited by worker processes
    return path


@pytest.fixture(scope="session")
def tiny_model_path(posttrain_cache: str) -> str:
    """The HF directory of ``preset:tiny-qwen2``, built once per session."""
    from posttrain.tasks.presets import preset_path

    return preset_path("preset:tiny-qwen2")
