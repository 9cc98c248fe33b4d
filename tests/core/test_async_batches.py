"""The asynchronous batch source's bookkeeping (see posttrain.rollout.batches): batches come in
step order, never more than ``max_staleness`` policy versions old, weight syncs happen between
generations, and a producer's failure reaches the loop."""

from __future__ import annotations

import threading

import pytest

from posttrain.rollout.batches import AsyncBatches
from posttrain.trainer.phase_timer import PhaseTimer


class Recorder:
    """Produces a stand-in batch per step (the scored groups are not looked at here) and
    records the steps it generated for."""

    def __init__(self, batches: list, fail_at: int | None = None):
        self.batches = batches
        self.generating = threading.Event()
        self.fail_at = fail_at

    def __call__(self, index, timer):
        with timer.phase("rollout"):
            self.generating.set()
            if index == self.fail_at:
                raise ValueError(f"engine failed at step {index}")
            self.batches.append(index)
            self.generating.clear()
        return f"batch {index}", {}, {"position": index}


def timer():
    return PhaseTimer(console=None, total_steps=0, start_step=0, show=False)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_batches_in_order_within_the_staleness_bound(max_staleness):
    produced: list = []
    recorder = Recorder(produced)
    source = AsyncBatches(recorder, 0, max_staleness, first=1, last=6, make_timer=timer)
    syncs = []
    try:
        for step in range(1, 7):
            batch = source.next(step, timer())
            assert batch.index == step and batch.sampler_state == {"position": step}
            assert 0 <= step - 1 - batch.policy_version <= max_staleness
            assert "async/rollout_s" in batch.timings

            def sync():
                # The engine is never generating while its weights change.
                syncs.append(recorder.generating.is_set())
                return {"bytes": 1}

            assert source.sync_weights(sync, version=step) == {"bytes": 1}
    finally:
        source.close()
    assert produced == [1, 2, 3, 4, 5, 6]
    assert syncs == [False] * 6


def test_a_producer_failure_reaches_the_loop():
    recorder = Recorder([], fail_at=2)
    source = AsyncBatches(recorder, 0, 1, first=1, last=4, make_timer=timer)
    try:
        source.next(1, timer())
        source.sync_weights(dict, version=1)
        with pytest.raises(ValueError, match="engine failed at step 2"):
            source.next(2, timer())
    finally:
        source.close()
