"""Training throughput of trainer strategies through posttrain, side by side in one run: tokens/s,
TFLOP/s and peak memory per rank for a Qwen2-shaped model built locally (random init), on CPU or
CUDA, with each row's ratio to the first strategy's tokens/s.

    python benchmarks/train_throughput.py --device cuda --ranks 2 --shape qwen2-1.5b \
        --batch 4 --seq 2048 --dtype bf16 --strategies fsdp2_train+deepspeed_train:zero_stage=3

Mixed precision (``--dtype bf16``): float32 master weights and bf16 compute for every strategy
(fsdp2_train's ``param_dtype``; deepspeed_train's bf16 mode through ``model_args.dtype``).
TFLOP/s counts 6 x params + causal attention per token (as shared/BACKENDS.md does).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from shapes import SHAPES
from trainer_runs import random_train_batch, trainer_group


def peak_memory(runtime) -> float:
    """Rank-side: peak GiB allocated on this rank's GPU (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


def build_model(shape: str, out_dir: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.tasks.presets import build_tokenizer

    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=shape != "qwen2-1.5b"
    )
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


# How each strategy is asked for bf16 compute over float32 master weights:
# (strategy_config entries, model_args.dtype).
MIXED_PRECISION = {
    "fsdp2_train": lambda dtype: ({"param_dtype": dtype}, "fp32"),
    "deepspeed_train": lambda dtype: ({}, dtype),
}


def parse_strategy(text: str) -> tuple[str, dict]:
    """``name`` or ``name:key=value,key=value`` (integers where they parse)."""
    name, _, rest = text.partition(":")
    config = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        config[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, config


def measure(args, model_dir: str, strategy: str, extra: dict) -> dict:
    """Seconds per step (the first left out, unless it is the only one) and peak GiB per rank of
    one strategy."""
    from posttrain.launch.local import LocalLauncher

    raw, model_dtype = {"micro_batch_size": args.batch, **extra}, "fp32"
    if args.dtype != "fp32":
        precision, model_dtype = MIXED_PRECISION[strategy](args.dtype)
        raw.update(precision)
    launcher = LocalLauncher()
    try:
        group = trainer_group(
            launcher,
            strategy,
            raw,
            model_dir,
            model_dir,
            model_dtype=model_dtype,
            device=args.device,
            ranks=args.ranks,
            checkpointing=args.checkpointing,
            threads=None if args.device == "cuda" else 1,
        )
        batch = random_train_batch(args.batch * args.ranks, args.seq, dp_size=group.dp_size)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            group.call_dp("train_step", batch.split(group.dp_size))
            times.append(time.perf_counter() - start)
        peaks = group.call("run_function", "train_throughput:peak_memory")
    finally:
        launcher.shutdown()
    timed = times[1:] or times  # the first step warms up, unless it is the only one
    return {"step": sum(timed) / len(timed), "peak": max(peaks)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument(
        "--strategies",
        default="fsdp2_train",
        help="strategies separated by '+', each name or name:key=value,...; the first is the "
        "baseline (e.g. fsdp2_train+deepspeed_train:zero_stage=3)",
    )
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
    )
    strategies = [parse_strategy(text) for text in args.strategies.split("+")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(args.shape, tmp)
        for strategy, extra in strategies:
            results.append(measure(args, tmp, strategy, extra))
    cfg = SHAPES[args.shape]
    tokens = args.batch * args.ranks * args.seq
    attn = 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * args.seq  # causal: half of 12
    flops = tokens * (6 * params + attn)
    print(
        f"train throughput: {args.shape} ({params / 1e6:.0f}M params), {args.device} x "
        f"{args.ranks}, {args.dtype} compute, {tokens} tokens/step, checkpointing "
        f"{args.checkpointing}"
    )
    print(
        f"| {'strategy':<32} | {'s/step':>7} | {'tokens/s':>9} | {'TFLOP/s/GPU':>11} | "
        f"{'peak GiB/rank':>13} | {'vs first':>8} |"
    )
    print(f"| {'-' * 32} | {'-' * 7} | {'-' * 9} | {'-' * 11} | {'-' * 13} | {'-' * 8} |")
    base = tokens / results[0]["step"]
    for (strategy, extra), r in zip(strategies, results):
        name = strategy + "".join(f" {k}={v}" for k, v in extra.items())
        rate = tokens / r["step"]
        print(
            f"| {name:<32} | {r['step']:>7.3f} | {rate:>9.0f} | "
            f"{flops / r['step'] / 1e12 / args.ranks:>11.1f} | {r['peak']:>13.1f} | "
            f"{rate / base:>7.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
