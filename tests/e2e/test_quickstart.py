"""README command 1's workflow learns: reward from chance to >= 0.8 (last 10 steps)."""

import pytest
from conftest import read_metrics, run_quickstart


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_learns_addition(tmp_path, e2e_cache):
    run_dir = tmp_path / "run"
    run_quickstart(
        run_dir, "--set", "trainer.resume=never", "--set", "trainer.logger=[jsonl]", timeout=580
    )
    metrics = read_metrics(run_dir)
    rewards = [m["reward/mean"] for m in metrics]
    assert len(rewards) == 400
    assert sum(rewards[:5]) / 5 < 0.2, "the tiny model should start near chance"
    assert sum(rewards[-10:]) / 10 >= 0.8
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert (run_dir / "checkpoint-400" / "manifest.json").exists()
