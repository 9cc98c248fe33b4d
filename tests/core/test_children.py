"""A rank that leaves through ``os._exit`` ends the processes it started through multiprocessing
first: a Manager server (what megatron-core's asynchronous checkpoint writer starts) was left
running, orphaned, after the megatron tests' ranks were done."""

from __future__ import annotations

import os
import time

import pytest

# What keeps the rank's Manager alive until the rank ends, as megatron-core's module-level queue
# does (a Manager no one refers to any more is shut down when it is collected).
KEPT: list = []


def scenario_start_a_manager(rank: int, world_size: int, out_dir: str) -> None:
    """A rank that starts a multiprocessing Manager, as a library would, and never shuts it."""
    import multiprocessing

    KEPT.append(multiprocessing.get_context("spawn").Manager().Queue())
    KEPT[-1].put(rank)  # the server answers: it is running
    (pid,) = (child.pid for child in multiprocessing.active_children())
    with open(os.path.join(out_dir, "manager.pid"), "w") as f:
        f.write(str(pid))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
def test_a_test_rank_leaves_no_multiprocessing_child_behind(tmp_path):
    from posttrain.testing.spawn import run_ranks

    run_ranks(f"{__name__}:scenario_start_a_manager", 1, str(tmp_path), timeout=90.0)
    pid = int((tmp_path / "manager.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), f"the rank's Manager server (pid {pid}) outlived it"
