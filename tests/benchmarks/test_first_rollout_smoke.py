"""benchmarks/first_rollout.py in its smallest setting (tiny shape, CPU, ``auto`` compiling in the
background with Dynamo's eager backend): the first rollouts are served uncompiled, the ones
after the compile compiled. The figures are not checked."""

from __future__ import annotations

import pytest
from test_benchmarks_smoke import column, table

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_first_rollout(run_benchmark):
    out = run_benchmark(
        "first_rollout.py", "--device", "cpu", "--shape", "tiny", "--batch", "4",
        "--new-tokens", "8", "--modes", "auto", "--steps", "2", "--after", "1",
        "--backend", "eager", "--top-k", "8",
    )  # fmt: skip
    header, rows = table(out, "mode")
    assert column(rows) == ["auto"] and "ready to first rollout s" in header
    assert rows[0][header.index("served first")] == "static"
    assert rows[0][header.index("compiled from step")] == "3"
    _, steps = table(out, "step")
    assert [cells[1].split()[-1] for cells in steps] == ["(static)", "(static)", "(compiled)"]
