"""The SGLang plugin's tests run only where SGLang is installed (the .venv-sglang environment,
built by .ci/sglang_env.sh); elsewhere the whole folder is skipped."""

from __future__ import annotations

import pytest

# A module of the engine itself: with tests/ on sys.path (its conftest), a bare "sglang" would
# also import this folder as an empty namespace package where sglang is not installed.
pytest.importorskip("sglang.version")
pytest.importorskip("posttrain_sglang")


@pytest.fixture(scope="session", autouse=True)
def _no_engine_leftovers():
    """Every engine of the session is shut down and its shared-memory files removed: compare
    /dev/shm before and after. Files that programs running beside the tests create meanwhile
    are told apart by being mapped by a live process, as the plugin itself does (a program
    beside the tests that leaks its own semaphores would be blamed here: CI runs alone)."""
    from posttrain_sglang import leftovers

    before = leftovers.shm_snapshot()
    yield
    left = leftovers.shm_snapshot() - before
    inodes = leftovers.mapped_inodes()
    unused = sorted(n for n in left if not leftovers.in_use(n, inodes))
    assert not unused, f"files left in /dev/shm by the session's engines: {unused}"
