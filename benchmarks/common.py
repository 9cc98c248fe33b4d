"""What the benchmarks share: the model shapes, a random model of a shape, a workflow run through
the CLI, a printed table, the device and its peak, and the FLOPs of a token.

Benchmarks are scripts run from anywhere (``python benchmarks/X.py``): Python puts this folder
first on ``sys.path``, so they import this module as ``common``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
# ``--tiny``: the quickstart as a smoke check (seconds on CPU): one rank process, 4 prompts x 2
# samples a step, no final checkpoint, and a Ray instance (if the run starts one) with a 256 MiB
# object store, as tests/e2e/test_ray.py starts its own (the local launcher ignores it).
TINY_QUICKSTART = (
    "actor_train.device_mapping=[0]",
    "actor_infer.device_mapping=[0]",
    "reference.device_mapping=[0]",
    "algorithm.rollout_batch_size=4",
    "algorithm.group_size=2",
    "trainer.save_final=false",
    "cluster.object_store_memory=268435456",
)

# Models the benchmarks build locally (random init, no download): Qwen2 unless ``arch`` says
# ``llama`` or ``qwen3_moe`` (mixture of experts: ``num_experts`` a layer, the top
# ``num_experts_per_tok`` of them per token); the larger ones keep their real model's untied
# output layer (``tie``).
SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "qwen2-100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie=False,
    ),
    "llama3.1-8b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie=False,
    ),
    # Qwen2.5-32B's geometry with 16 of its 64 layers: tensor and pipeline parallelism at 32B's
    # widths without 32B's memory.
    "qwen2.5-32b-l16": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=16,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie=False,
    ),
    # Qwen3-MoE at CPU size: the MoE benchmarks' smoke tests (8 experts, top-2, renormalised).
    "tiny-moe": dict(
        arch="qwen3_moe",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        vocab_size=1024,
        tie=False,
    ),
    # Qwen3-30B-A3B's geometry with 12 of its 48 layers (every layer sparse: 128 experts, the
    # top 8 renormalised): 8.1B parameters, 1.3B of them active per token (0.6B of those the
    # embedding and the output layer).
    "qwen3-30b-a3b-l12": dict(
        arch="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        vocab_size=151936,
        tie=False,
    ),
}

# Dense bf16 peak TFLOP/s of a GPU, by a part of its name (SXM parts).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


class BuiltModel(NamedTuple):
    params: int  # the tied embedding counted once
    nbytes: int  # of the weights in the saved dtype


def build_model(
    shape: str,
    out_dir: str,
    *,
    dtype: str = "fp32",
    max_positions: int = 4096,
    tie_word_embeddings: bool | None = None,
    device: str = "cpu",
) -> BuiltModel:
    """A model of ``shape`` (random init, seed 0) saved in ``dtype`` as sharded safetensors,
    with the tokenizer of ``preset:tiny-qwen2`` (the arithmetic alphabet: the model's
    vocabulary is larger than the tokenizer's). ``tie_word_embeddings``: None keeps the shape's
    own (tied unless it says ``tie=False``). ``device``: where the weights are initialised
    (``cuda`` builds an 8B model in seconds, where the CPU takes minutes)."""
    import torch
    import transformers

    from posttrain.backend import torch_dtype
    from posttrain.tasks.presets import preset_path

    config, model_class = model_config(shape, max_positions, tie_word_embeddings)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_class)(config).to(torch_dtype(dtype))
    model.save_pretrained(out_dir, max_shard_size="4GB")
    # Copied as the preset saved it: the saved class keeps every loader (posttrain's, an
    # engine's own, another transformers version) reading the same vocabulary.
    copy_tokenizer(preset_path("preset:tiny-qwen2"), out_dir)
    params = list(model.parameters())
    built = BuiltModel(
        params=sum(p.numel() for p in params),
        nbytes=sum(p.numel() * p.element_size() for p in params),
    )
    del model, params
    if device == "cuda":
        torch.cuda.empty_cache()  # the benchmark's ranks need the whole card
    return built


def model_config(shape: str, max_positions: int = 4096, tie_word_embeddings: bool | None = None):
    """The transformers config of ``shape`` and the name of its model class."""
    import transformers

    geometry = dict(SHAPES[shape])
    arch = geometry.pop("arch", "qwen2")
    tied = geometry.pop("tie", True) if tie_word_embeddings is None else tie_word_embeddings
    config_class, model_class = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }[arch]
    config = getattr(transformers, config_class)(
        **geometry, max_position_embeddings=max_positions, tie_word_embeddings=tied
    )
    return config, model_class


def copy_tokenizer(from_dir: str | Path, to_dir: str | Path) -> None:
    """The tokenizer files of the HF directory ``from_dir``, copied into ``to_dir``."""
    for path in Path(from_dir).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, to_dir)


def posttrain_run_command(workflow: str | Path, overrides: Sequence[str]) -> list[str]:
    """``posttrain run WORKFLOW --set KEY=VALUE ...`` with this interpreter."""
    command = [sys.executable, "-m", "posttrain.cli", "run", str(workflow)]
    for item in overrides:
        command += ["--set", item]
    return command


class WorkflowRun(NamedTuple):
    metrics: list[dict[str, Any]]  # one record per step, from the run's metrics.jsonl
    wall_s: float  # the whole command: start-up, steps, teardown
    stdout: str


def run_workflow(
    workflow: str | Path, overrides: Sequence[str], env: dict[str, str] | None = None
) -> WorkflowRun:
    """Run ``workflow`` through the CLI in a subprocess, into a temporary run directory that the
    JSONL logger writes, with ``--set`` ``overrides`` (later ones win). A failed run ends the
    benchmark with its output's tail. With ``BENCH_RUN_LOG`` set, the run's output goes to that
    file as it is written (a GPU machine's call that runs out of time still shows how far the
    run got)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        live = os.environ.get("BENCH_RUN_LOG")
        loggers = "[jsonl,console]" if live else "[jsonl]"
        command = posttrain_run_command(
            workflow, [f"trainer.output_dir={run_dir}", f"trainer.logger={loggers}", *overrides]
        )
        log_path = Path(live or Path(tmp) / "run.log")
        start = time.perf_counter()
        with open(log_path, "a") as log:
            returncode = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env=env
            ).returncode
        wall = time.perf_counter() - start
        output = log_path.read_text()
        if returncode:
            sys.exit(f"posttrain run {workflow} failed (exit {returncode}):\n{output[-4000:]}")
        with open(run_dir / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f]
    return WorkflowRun(metrics, wall, output)


def steady(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps after the first (it warms caches up), or the only one."""
    return metrics[1:] if len(metrics) > 1 else metrics


def steady_step_s(metrics: list[dict[str, Any]]) -> float:
    return statistics.mean(m["time/step"] for m in steady(metrics))


def print_table(
    rows: Sequence[dict[str, Any]],
    title: str | None = None,
    *,
    float_format: str = ".3f",
    formats: dict[str, str] | None = None,
    text_columns: int = 1,
) -> None:
    """A Markdown table of ``rows`` (their keys are the columns, in the first row's order) under
    ``title``. The first ``text_columns`` columns are left-aligned, the others right-aligned;
    floats are formatted with ``formats[column]``, else ``float_format``; None is ``-``,
    anything else ``str``."""
    if title:
        print(title)
    columns = list(rows[0]) if rows else []
    formats = formats or {}

    def text(column: str, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return format(value, formats.get(column, float_format))
        return str(value)

    cells = [[text(c, row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    left = [i < text_columns for i in range(len(columns))]

    def line(values: list[str]) -> str:
        padded = (v.ljust(w) if lj else v.rjust(w) for v, w, lj in zip(values, widths, left))
        return "| " + " | ".join(padded) + " |"

    print(line(columns))
    print(line(["-" * w if lj else "-" * (w - 1) + ":" for w, lj in zip(widths, left)]))
    for row in cells:
        print(line(row))


def device_name(device: str) -> str:
    """The GPU's name for ``cuda`` (device 0), else ``cpu``."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return "cpu"


def peak_bf16_tflops(name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of the GPU called ``name``; None where unknown (CPUs)."""
    return next((peak for part, peak in PEAK_BF16_TFLOPS.items() if part in name), None)


def flops_per_token(shape: str, params: int, seq: int, *, training: bool = True) -> float:
    """FLOPs per token of a Qwen2 of ``shape`` with ``params`` parameters over sequences of
    ``seq`` tokens: 2 * N for the forward matmuls (the tied embedding counted once: it is the
    output layer's matmul; the lookup costs nothing; N the active parameters of a mixture of
    experts, :func:`active_params`) and 2 * L * h * s for causal attention (QK^T and AV,
    4 * s * h per token and layer, halved by the mask; h the attention's width, heads x
    head_dim where the shape sets head_dim); training (forward and backward) is 3 times the
    forward: 6 * N + 6 * L * h * s."""
    cfg = SHAPES[shape]
    width = (
        cfg["num_attention_heads"] * cfg["head_dim"] if "head_dim" in cfg else cfg["hidden_size"]
    )
    per_pass = 2.0 * active_params(shape, params) + 2.0 * cfg["num_hidden_layers"] * width * seq
    return 3 * per_pass if training else per_pass


def active_params(shape: str, params: int) -> int:
    """The parameters a token runs through: ``params`` less the experts a token is not routed
    to (each a gated MLP, 3 x hidden x moe_intermediate_size) in every layer."""
    cfg = SHAPES[shape]
    if "num_experts" not in cfg:
        return params
    expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    idle = cfg["num_experts"] - cfg["num_experts_per_tok"]
    return params - cfg["num_hidden_layers"] * idle * expert
