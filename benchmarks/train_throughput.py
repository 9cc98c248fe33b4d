"""Training throughput of trainer strategies through posttrain, side by side in one run: tokens/s,
TFLOP/s and peak memory per rank for a Qwen2-shaped model built locally (random init), on CPU or
CUDA, with each row's ratio to the first strategy's tokens/s.

    python benchmarks/train_throughput.py --device cuda --ranks 2 --shape qwen2-1.5b \
        --batch 4 --seq 2048 --dtype bf16 --strategies fsdp2_train+deepspeed_train:zero_stage=3
    python benchmarks/train_throughput.py --ranks 1 --batch 1 --seq 32 --steps 1  # smoke check
    python benchmarks/train_throughput.py --device cuda --ranks 1 --shape qwen2-1.5b --batch 4 \
        --seq 2048 --dtype bf16 --strategies fsdp2_train+fsdp2_train:lora_rank=16,lora_alpha=32

Mixed precision (``--dtype bf16``): float32 master weights and bf16 compute for every strategy
(fsdp2_train's ``param_dtype``; deepspeed_train's bf16 mode through ``model_args.dtype``).
TFLOP/s counts 6 x params + causal attention per token (the usual training-FLOPs estimate).
``lora_*`` entries of a strategy are ``model_args.lora``'s (``lora_rank=16``: adapters on every
attention and MLP projection), not ``strategy_config``'s: LoRA against full fine-tuning.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from common import SHAPES, build_model, flops_per_token, print_table
from trainer_runs import random_train_batch, trainer_group


def peak_memory(runtime) -> float:
    """Rank-side: peak GiB allocated on this rank's GPU (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


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
    from posttrain.config.sections import LoraArgs
    from posttrain.launch.local import LocalLauncher

    lora_keys = {k: v for k, v in extra.items() if k.startswith("lora_")}
    lora = (
        LoraArgs(**{k.removeprefix("lora_"): v for k, v in lora_keys.items()})
        if lora_keys
        else None
    )
    extra = {k: v for k, v in extra.items() if k not in lora_keys}
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
            lora=lora,
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
    # The ranks call this module's peak_memory by name: they import it from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
    )
    strategies = [parse_strategy(text) for text in args.strategies.split("+")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(
            args.shape,
            tmp,
            max_positions=8192,
            tie_word_embeddings=args.shape != "qwen2-1.5b",
        ).params
        for strategy, extra in strategies:
            results.append(measure(args, tmp, strategy, extra))
    tokens = args.batch * args.ranks * args.seq
    flops = tokens * flops_per_token(args.shape, params, args.seq)
    base = tokens / results[0]["step"]
    rows = []
    for (strategy, extra), r in zip(strategies, results):
        rate = tokens / r["step"]
        rows.append(
            {
                "strategy": strategy + "".join(f" {k}={v}" for k, v in extra.items()),
                "s/step": r["step"],
                "tokens/s": f"{rate:.0f}",
                "TFLOP/s/GPU": f"{flops / r['step'] / 1e12 / args.ranks:.1f}",
                "peak GiB/rank": f"{r['peak']:.1f}",
                "vs first": f"{rate / base:.2f}x",
            }
        )
    print_table(
        rows,
        f"train throughput: {args.shape} ({params / 1e6:.0f}M params), {args.device} x "
        f"{args.ranks}, {args.dtype} compute, {tokens} tokens/step, checkpointing "
        f"{args.checkpointing}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
