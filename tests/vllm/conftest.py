"""The vLLM plugin's tests run only where vLLM is installed (the .venv-vllm environment)."""

from __future__ import annotations

import pytest

# A module of the engine itself: with tests/ on sys.path (its conftest), a bare "vllm" would
# also import this folder as an empty namespace package where vllm is not installed.
pytest.importorskip("vllm.version")
pytest.importorskip("posttrain_vllm")


@pytest.fixture(scope="session")
def tiny_model_path(posttrain_cache):
    """vLLM's CPU attention has no kernel for head size 16 (``preset:tiny-qwen2``: hidden 64,
    4 heads); its supported sizes start at 32. The vLLM tests use ``preset:tiny-qwen2-head32``
    (hidden 128, 4 heads of 32), as examples/quickstart_vllm.yaml does."""
    from posttrain.tasks.presets import preset_path

    return preset_path("preset:tiny-qwen2-head32")
