"""The memory watch (posttrain.trainer.memory_watch): quiet while memory stays flat or wobbles,
a warning naming the figure once it grows past the settled baseline, and again only after as
much further growth."""

from __future__ import annotations

from posttrain.trainer.memory_watch import SETTLE_STEPS, MemoryWatch


def watch_steps(series: list[float]) -> list[str]:
    said: list[str] = []
    watch = MemoryWatch(said.append)
    for step, value in enumerate(series, start=1):
        watch.check(step, {"memory/rank_rss_gib": value, "reward/mean": 100.0 * step})
    return said


def test_flat_or_wobbling_memory_says_nothing():
    assert watch_steps([1.0, 2.0, 3.0, 3.1, 3.0] + [3.2, 2.9, 3.25] * 30) == []


def test_growth_past_the_baseline_is_named_once_per_as_much_growth():
    settled = [2.0] * SETTLE_STEPS
    creeping = [2.0 + 0.05 * i for i in range(1, 41)]  # +2 GiB over 40 steps
    said = watch_steps(settled + creeping)
    assert said[0].startswith("warning: memory/rank_rss_gib grew from 2.00 GiB"), said
    assert f"at step {SETTLE_STEPS + 6}" in said[0], said  # 2.30 > 2.2 and +0.3 GiB
    assert 2 <= len(said) <= 8, said  # each further 10% (and 0.25 GiB), not every step
