"""Fixtures of the FSDP2 plugin tests: a private preset cache and the multi-process runs.

The expensive runs (1 rank, 2 ranks, 2 ranks resuming) happen once per session; each test
compares what they wrote.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("posttrain_fsdp")


@pytest.fixture(scope="session", autouse=True)
def _preset_cache(tmp_path_factory):
    """Build the tiny preset once, in a directory of this session (children inherit it)."""
    old = os.environ.get("POSTTRAIN_CACHE")
    os.environ["POSTTRAIN_CACHE"] = str(tmp_path_factory.mktemp("posttrain-cache"))
    from fsdp_workers import MODEL

    from posttrain.tasks.presets import preset_path

    preset_path(MODEL)
    yield
    if old is None:
        os.environ.pop("POSTTRAIN_CACHE", None)
    else:
        os.environ["POSTTRAIN_CACHE"] = old


@pytest.fixture(scope="session")
def single_run(tmp_path_factory):
    from fsdp_workers import launch

    out = tmp_path_factory.mktemp("fsdp-w1")
    launch("train", 1, str(out))
    return out


@pytest.fixture(scope="session")
def dp2_run(tmp_path_factory):
    from fsdp_workers import launch

    out = tmp_path_factory.mktemp("fsdp-w2")
    launch("train", 2, str(out), extras=True)
    return out


@pytest.fixture(scope="session")
def resume_run(dp2_run):
    from fsdp_workers import launch

    launch("resume", 2, str(dp2_run))
    return dp2_run
