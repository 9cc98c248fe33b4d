"""Every script in benchmarks/ runs in its smallest setting (the tiny shape or preset, one or two
steps, CPU) and prints its table, so that a change of core's or a plugin's API that breaks a
benchmark fails here. The figures printed are not checked: these tests measure nothing.

The engines that the main test environment lacks: vLLM and SGLang (benchmarks/vllm_rollout.py,
benchmarks/sglang_rollout.py) drive an engine from their first step, so only their argument
parsing is checked here; their smallest runs are tests/vllm/test_vllm_benchmark.py and
tests/sglang/test_sglang_benchmark.py, in those engines' environments. TRL
(benchmarks/trl_grpo_side.py, the TRL side of benchmarks/vs_trl.py) lives in its own virtual
environment (benchmarks/trl_env.sh .venv-trl): here its argument parsing always runs, and the
posttrain side of vs_trl.py in both modes; both sides of the learning mode run where .venv-trl
exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TRL_PYTHON = Path(__file__).resolve().parents[2] / ".venv-trl" / "bin" / "python"

pytestmark = pytest.mark.slow


def table(out: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows, as stripped cells, of the Markdown table printed in ``out``
    whose first column is called ``first_column``."""

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    lines = out.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("|") and cells(line)[0] == first_column
    )
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return cells(lines[start]), rows


def column(rows: list[list[str]], index: int = 0) -> list[str]:
    return [row[index] for row in rows]


@pytest.mark.timeout(150)
def test_checkpoint(run_benchmark, tmp_path):
    out = run_benchmark(
        "checkpoint.py", "--shape", "tiny", "--seq", "32", "--strategies", "fsdp2_train",
        "--dir", str(tmp_path),
    )  # fmt: skip
    header, rows = table(out, "strategy")
    assert "stall s" in header and column(rows) == ["fsdp2_train"]


@pytest.mark.timeout(150)
def test_weight_sync(run_benchmark):
    out = run_benchmark("weight_sync.py", "--trainers", "fsdp2_train", "--repeats", "1")
    _, rows = table(out, "trainer")
    assert column(rows, 2) == ["in_process", "shared_memory"]


@pytest.mark.timeout(150)
def test_lora_sync(run_benchmark):
    out = run_benchmark(
        "lora_sync.py", "--rank", "4", "--layouts", "separate", "--repeats", "1"
    )  # fmt: skip
    _, counts = table(out, "shape")
    assert column(counts) == ["tiny"]
    _, timed = table(out, "layout")
    assert column(timed, 1) == ["merged", "adapter"]
    merged_mb, adapter_mb = (float(row[2]) for row in timed)
    assert 0 < adapter_mb < merged_mb / 2  # what the transport moved: the adapters alone


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_weight_sync_parity(run_benchmark):
    out = run_benchmark("weight_sync_parity.py", "--ranks", "1", "--steps", "1")
    header, rows = table(out, "transport")
    assert "max abs dlogp" in header
    assert column(rows) == ["shared_memory", "broadcast"]


@pytest.mark.timeout(150)
def test_train_throughput(run_benchmark):
    out = run_benchmark(
        "train_throughput.py", "--ranks", "1", "--batch", "1", "--seq", "32", "--steps", "1"
    )
    header, rows = table(out, "strategy")
    assert "tokens/s" in header and column(rows) == ["fsdp2_train"]


@pytest.mark.extended
@pytest.mark.timeout(210)
def test_megatron_train(run_benchmark):
    """Every row (each its own process) in the tiny shape, one timed step, no warm-up."""
    out = run_benchmark(
        "megatron_train.py", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
        timeout=180,
    )  # fmt: skip
    _, rows = table(out, "row")
    assert set(column(rows)) == {"megatron_train", "megatron_local", "transformers"}
    assert "export_weights (512 MiB buckets)" in out
    assert "packed:" in out


@pytest.mark.timeout(150)
def test_quickstart(run_benchmark):
    """Against the code of HEAD (a git worktree of it): the phase table of this tree's run and
    the code-against-code table."""
    out = run_benchmark(
        "quickstart.py", "--tiny", "--steps", "1", "--save-steps", "0", "--base", "HEAD"
    )
    _, rows = table(out, "phase")
    assert column(rows)[0] == "rollout" and column(rows)[-1] == "step"
    _, rows = table(out, "code")
    assert column(rows) == ["base (HEAD)", "this tree", "this tree / base"]


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_ray_vs_local(run_benchmark):
    out = run_benchmark("ray_vs_local.py", "--tiny", "--steps", "1")
    header, rows = table(out, "")
    assert header == ["", "local", "ray", "ray/local"]
    assert column(rows)[0] == "mean step time, step 1 excl. (s)"


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_async_rollout(run_benchmark):
    """A random model of the tiny shape (the path that builds one), one step per mode."""
    out = run_benchmark(
        "async_rollout.py", "--shape", "tiny", "--steps", "1", "--rollout-batch-size", "4",
        "--set", "algorithm.group_size=2",
    )  # fmt: skip
    header, rows = table(out, "")
    assert "trainer_idle_s" in header
    assert column(rows) == ["sync", "async", "async / sync"]


@pytest.mark.extended
@pytest.mark.timeout(90)
def test_calculator_preset(run_benchmark):
    out = run_benchmark(
        "calculator_preset.py", "--prompts", "4", "--samples", "1", "--warm-start-steps", "2"
    )
    assert "tool-call rate:" in out
    assert "samples: 4 (4 prompts x 1)" in out


@pytest.mark.timeout(150)
def test_vs_trl_posttrain_side(run_benchmark, tmp_path):
    """The shortest run the script accepts (steps beyond the warm-up steps), no TRL."""
    out = run_benchmark(
        "vs_trl.py", "--only", "posttrain", "--steps", "6", "--window", "1", "--repeats", "1",
        "--sft-steps", "1", "--work-dir", str(tmp_path / "work"),
    )  # fmt: skip
    header, rows = table(out, "")
    assert header == ["", "posttrain"]
    assert column(rows)[0].startswith("wall time per step")


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_vs_trl_speed_posttrain_side(run_benchmark, tmp_path):
    """The speed mode's smallest setting (the GPU mode's batch and lengths on the tiny shape, on
    CPU), one warm-up step and one steady step, no TRL."""
    out = run_benchmark(
        "vs_trl.py", "--shape", "tiny", "--device", "cpu", "--steps", "2", "--only", "posttrain",
        "--work-dir", str(tmp_path / "work"),
    )  # fmt: skip
    header, rows = table(out, "")
    assert header == ["", "posttrain"]
    assert column(rows)[0].startswith("per-step time")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="no TRL venv: benchmarks/trl_env.sh .venv-trl")
def test_vs_trl_both_sides(run_benchmark, tmp_path):
    out = run_benchmark(
        "vs_trl.py", "--steps", "6", "--window", "1", "--repeats", "1", "--sft-steps", "1",
        "--trl-python", str(TRL_PYTHON), "--work-dir", str(tmp_path / "work"),
        timeout=270,
    )  # fmt: skip
    header, rows = table(out, "")
    assert header == ["", "posttrain", "TRL", "pt/TRL"]
    assert column(rows)[0].startswith("wall time per step")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", ["vllm_rollout.py", "sglang_rollout.py", "trl_grpo_side.py"])
def test_engine_benchmarks_parse_their_arguments(run_benchmark, script):
    """Without their engine, these scripts get as far as their arguments (and their imports)."""
    out = run_benchmark(script, "--help")
    assert out.startswith("usage:")


@pytest.mark.timeout(150)
def test_rl_step(run_benchmark):
    """The tiny shape and workload, one steady step, profiled: the phase table, the slowest
    rank's time in each phase, and a phase's profile."""
    out = run_benchmark(
        "rl_step.py", "--shape", "tiny", "--workload", "tiny", "--steps", "2", "--profile"
    )
    header, rows = table(out, "phase")
    assert column(rows) == ["rollout", "logprobs", "train", "weight_sync", "step"]
    assert "TFLOP/s/GPU" in header and "on ranks s" in header
    assert "## profile: train_step.actor_train.rank0" in out


def test_token_sampling(run_benchmark):
    out = run_benchmark(
        "token_sampling.py", "--rows", "4", "--vocab", "1000", "--calls", "2", "--modes", "general"
    )
    header, rows = table(out, "mode")
    assert "us per draw" in header and column(rows) == ["general"]


def test_decode_attention(run_benchmark):
    out = run_benchmark(
        "decode_attention.py", "--rows", "2", "--windows", "16", "--heads", "4", "--kv-heads",
        "2", "--dim", "16", "--layers", "2",
    )  # fmt: skip
    header, rows = table(out, "mode")
    assert "us per layer" in header and "KV GB/s" in header and column(rows) == ["sdpa"]


@pytest.mark.timeout(150)
def test_generation(run_benchmark):
    out = run_benchmark(
        "generation.py", "--shape", "tiny", "--device", "cpu", "--batches", "4",
        "--new-tokens", "8", "--adapter-rank", "4",
    )  # fmt: skip
    header, rows = table(out, "mode")
    assert "decode tok/s" in header and column(rows) == [
        "before", "dynamic", "dynamic +lora4", "static", "static +lora4",
    ]  # fmt: skip
    # fp32 on the CPU: every mode returns what a forward pass scores, with adapters too.
    assert all(float(gap) < 1e-5 for gap in column(rows, header.index("logp gap")))


@pytest.mark.extended
def test_continuous_batching(run_benchmark):
    out = run_benchmark(
        "continuous_batching.py", "--shape", "tiny", "--device", "cpu", "--prompts", "12",
        "--rows", "4", "--new-tokens", "16", "--mean-length", "6", "--refill-shares", "1", "4",
    )  # fmt: skip
    header, rows = table(out, "mode")
    assert "tok/s" in header and column(rows) == [
        "dynamic",
        "batched",
        "continuous, refill at 1/1 free",
        "continuous, refill at 1/4 free",
    ]
    # Refilled only once every row is free: the batched run's samples.
    tokens = column(rows, header.index("new tokens"))
    assert tokens[2] == tokens[1]
