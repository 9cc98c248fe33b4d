"""The generation benchmark on a mixture-of-experts shape (``tiny-moe``, the CPU setting of
``--shape qwen3-30b-a3b-l12``): every mode decodes, returns the routing asked for, and scores
what a forward pass scores."""

from __future__ import annotations

import pytest
from test_benchmarks_smoke import column, table


# A subprocess that builds and loads a model (half a minute on a loaded CPU): extended, as the
# dense shape's tiny setting (test_benchmarks_smoke.py) already runs the script in CI.
@pytest.mark.extended
@pytest.mark.timeout(150)
def test_generation_of_a_mixture_of_experts(run_benchmark):
    out = run_benchmark(
        "generation.py", "--shape", "tiny-moe", "--device", "cpu", "--batches", "4",
        "--new-tokens", "8", "--modes", "dynamic", "static", "--routing",
    )  # fmt: skip
    header, rows = table(out, "mode")
    assert "decode tok/s" in header and column(rows) == ["dynamic", "static"]
    assert all(float(gap) < 1e-5 for gap in column(rows, header.index("logp gap")))
