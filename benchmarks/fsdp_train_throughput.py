"""Training throughput of fsdp2_train through posttrain: tokens/s, TFLOP/s and peak memory per
rank for a Qwen2-shaped model built locally (random init), on CPU or CUDA.

    python benchmarks/fsdp_train_throughput.py --device cuda --ranks 2 --shape qwen2-1.5b \
        --batch 4 --seq 2048 --param-dtype bf16

TFLOP/s counts 6 x params + causal attention per token (as shared/BACKENDS.md does).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
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
}


def peak_memory(runtime) -> float:
    """Rank-side: peak GiB allocated on this rank's GPU (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


def build_model(shape: str, out_dir: str) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.presets import build_tokenizer

    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=shape != "qwen2-1.5b"
    )
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--param-dtype", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
    )
    import torch

    from posttrain.config.converter import CONVERTER
    from posttrain.config.sections import (
        AlgorithmConfig,
        ModelArgs,
        RoleConfig,
        StrategyArgs,
        TrainingArgs,
    )
    from posttrain.launcher.base import GroupSpec
    from posttrain.launcher.local import LocalLauncher
    from posttrain.plugin_host import create_plugin_host
    from posttrain.protocol import build_sequence_batch

    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(args.shape, tmp)
        spec = create_plugin_host().strategies()["fsdp2_train"]
        raw = {"micro_batch_size": args.batch}
        if args.param_dtype:
            raw["param_dtype"] = args.param_dtype
        config = CONVERTER.structure(raw, spec.config_class)
        role = RoleConfig(
            strategy_args=StrategyArgs(strategy_name="fsdp2_train", strategy_config=config),
            device_mapping=tuple(range(args.ranks)),
            model_args=ModelArgs(
                model_name_or_path=tmp, disable_gradient_checkpointing=not args.checkpointing
            ),
            training_args=TrainingArgs(learning_rate=1e-5),
        )
        launcher = LocalLauncher()
        try:
            group = launcher.start_group(
                GroupSpec(
                    role="actor_train",
                    config=role,
                    algorithm=AlgorithmConfig(),
                    seed=0,
                    run_dir=tmp,
                    base_dir=tmp,
                    device=args.device,
                    threads=None if args.device == "cuda" else 1,
                )
            )
            gen = torch.Generator().manual_seed(0)
            rows = args.batch * args.ranks
            prompts = [torch.randint(10, 1000, (16,), generator=gen).tolist()] * rows
            responses = [
                torch.randint(10, 1000, (args.seq - 16,), generator=gen).tolist()
                for _ in range(rows)
            ]
            batch = build_sequence_batch(prompts, responses, 0)
            batch = batch.with_tensors(
                old_logprobs=torch.full_like(batch.response_mask, -7.0),
                advantages=torch.randn(rows, generator=gen)[:, None] * batch.response_mask,
            )
            batch.meta.update(
                global_tokens=float(batch.response_mask.sum()),
                global_seqs=float(rows),
                dp_size=group.dp_size,
            )
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                group.call_dp("train_step", batch.split(group.dp_size))
                times.append(time.perf_counter() - start)
            peaks = group.call("run_function", "fsdp_train_throughput:peak_memory")
        finally:
            launcher.shutdown()
    cfg = SHAPES[args.shape]
    tokens = rows * args.seq
    step = sum(times[1:]) / max(1, len(times) - 1)
    attn = 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * args.seq  # causal: half of 12
    flops = tokens * (6 * params + attn)
    print(
        f"fsdp2_train throughput: {args.shape} ({params / 1e6:.0f}M params), {args.device} x "
        f"{args.ranks}, param_dtype {args.param_dtype or 'fp32'}, "
        f"checkpointing {args.checkpointing}"
    )
    print(
        f"{'tokens/step':>12} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'TFLOP/s/GPU':>11}"
        f" {'peak GiB/rank':>13}"
    )
    print(
        f"{tokens:>12} {step:>8.3f} {tokens / step:>10.0f} {flops / step / 1e12:>8.1f} "
        f"{flops / step / 1e12 / args.ranks:>11.1f} {max(peaks):>13.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
