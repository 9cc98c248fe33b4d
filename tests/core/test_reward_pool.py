"""A reward that raises, hangs or returns garbage scores 0, is counted, and the next call works."""

from __future__ import annotations

import time

import pytest
from flaky_rewards import flaky

from posttrain.rewards.pool import RuleRewards

ITEMS = [
    ("7", "7", "3+4="),
    ("raise", "7", ""),
    ("garbage", "7", ""),
    ("nan", "7", ""),
    ("8", "7", ""),
]


def test_in_the_driver_failures_score_zero_and_are_counted():
    results = RuleRewards(flaky, "flaky_rewards:flaky", {})(ITEMS)
    assert results.scores == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert (results.errors, results.timeouts) == (3, 0)


@pytest.mark.timeout(120)
def test_in_a_pool_hangs_time_out_and_the_pool_recovers():
    rewards = RuleRewards(flaky, "flaky_rewards:flaky", {}, num_workers=2, timeout_s=0.5)
    try:
        results = rewards([*ITEMS, ("hang", "7", ""), ("7", "7", "")])
        assert results.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert (results.errors, results.timeouts) == (3, 1)
        # A call deaf to its timer: the pool is killed, the rest of that call scores 0...
        start = time.monotonic()
        results = rewards([("deaf", "7", ""), ("7", "7", "")])
        assert time.monotonic() - start < 10
        assert results.timeouts >= 1 and results.scores[0] == 0.0
        # ...and the next call gets a fresh pool.
        assert rewards([("7", "7", ""), ("5", "7", "")]).scores == [1.0, 0.0]
    finally:
        rewards.close()
