"""The benchmarks of memory over a long run, of a killed rank, and of the weight sync's check
(benchmarks/memory_flat.py, benchmarks/rank_kill.py, benchmarks/weight_sync.py --verify) run in
their smallest setting (the tiny shape, a few steps, CPU) and print their tables, as
test_benchmarks_smoke.py runs the others. The figures are not checked, except rank_kill.py's
verdicts on the promises that hold on any machine (the error names the rank; the rerun is the
same run, bitwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_benchmarks_smoke import column, table

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_memory_flat(run_benchmark):
    out = run_benchmark("memory_flat.py", "--shape", "tiny", "--device", "cpu", "--steps", "6")
    header, rows = table(out, "figure")
    # 6 steps: the first steady step (2) is the baseline.
    assert header[1:3] == ["step 2 GiB", "step 6 GiB"] and "growth %" in header
    assert {"rank_rss_gib", "driver_rss_gib"} <= set(column(rows))
    assert "memory watch warned: " in out


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_memory_flat_of_the_quickstart(run_benchmark):
    """A workflow file instead of the GRPO workload (one rank, small batches): on the CPU,
    resident memory only."""
    out = run_benchmark(
        "memory_flat.py", "--workflow", str(QUICKSTART), "--device", "cpu", "--steps", "3",
        "--set", "actor_train.device_mapping=[0]", "--set", "actor_infer.device_mapping=[0]",
        "--set", "reference.device_mapping=[0]", "--set", "algorithm.rollout_batch_size=4",
        "--set", "algorithm.group_size=2",
    )  # fmt: skip
    _, rows = table(out, "figure")
    assert set(column(rows)) == {"rank_rss_gib", "driver_rss_gib"}


@pytest.mark.timeout(300)
def test_rank_kill(run_benchmark):
    """Three runs of 3 steps on 2 gloo ranks: uninterrupted, rank 1 killed at step 3, the
    rerun."""
    out = run_benchmark(
        "rank_kill.py", "--device", "cpu", "--shape", "tiny", "--steps", "3", "--kill-at", "3",
        "--save-steps", "1", timeout=270,
    )  # fmt: skip
    _, rows = table(out, "measure")
    value = dict(rows)
    assert value["killed run"].startswith("exit ") and not value["killed run"].startswith("exit 0")
    assert float(value["kill -> driver exit (s)"]) >= 0
    assert value["error names rank 1"] == "yes"
    assert value["every step equal, bitwise"] == "3 of 3", out


@pytest.mark.timeout(150)
def test_weight_sync_verify_modes(run_benchmark):
    out = run_benchmark(
        "weight_sync.py", "--trainers", "fsdp2_train", "--repeats", "1", "--layouts", "hybrid",
        "--verify", "off", "every",
    )  # fmt: skip
    header, rows = table(out, "trainer")
    assert "vs off" in header
    assert column(rows, header.index("verify")) == ["off", "every"]
    assert column(rows, header.index("checked")) == ["0", "1"]  # the tiny model: one bucket
