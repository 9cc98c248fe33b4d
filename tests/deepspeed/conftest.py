"""Fixtures of the DeepSpeed plugin tests: the shared tiny model and the multi-process runs.

The expensive runs (1 rank; 2 ranks per ZeRO stage) happen once per session; each test compares
what they wrote.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("posttrain_deepspeed")
# Not imported here: DeepSpeed picks its accelerator once, at first import, and the rank
# processes that run it choose (the plugin sets DS_ACCELERATOR from the role's device).
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)


@pytest.fixture(scope="session", autouse=True)
def _tiny_model(tiny_model_path):
    """The tiny preset, built once per session in the kit's shared cache (``posttrain_cache``,
    which spawned ranks inherit through POSTTRAIN_CACHE)."""
    return tiny_model_path


@pytest.fixture(scope="session", params=[2, 3], ids=["zero2", "zero3"])
def stage(request):
    return request.param


@pytest.fixture(scope="session")
def runs(tmp_path_factory, stage):
    """``{"w1": dir, "w2": dir}`` for one ZeRO stage: 3 steps on 1 rank at the same stage (the
    reference: held against a 1-rank ZeRO-2 run, 2-rank ZeRO-3 lands ~1e-5 away, its flattening
    and reduction order differ), and on 2 ranks
    followed by weight export (both modes), HF export and dynamic / uneven variants.
    Checkpoint round trips are the conformance kit's (test_deepspeed_contract.py) and the
    SIGKILL resume test's (tests/e2e/test_resume_deepspeed.py)."""
    from ds_workers import launch

    one = tmp_path_factory.mktemp(f"ds-z{stage}-w1")
    launch("train", 1, str(one), stage=stage)
    two = tmp_path_factory.mktemp(f"ds-z{stage}-w2")
    launch("train", 2, str(two), stage=stage, extras=True)
    return {"w1": one, "w2": two}
