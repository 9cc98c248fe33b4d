"""Weight-sync throughput, trainer -> rollout on the same devices: the hybrid engine's in-process
hand-over against separate processes per role (shared memory through the driver).

Effective GB/s = bytes of the model's weights in its dtype / wall time of the whole sync phase
(the transport's run, as the loop times it). Median of the timed syncs after one warm-up.

    python benchmarks/weight_sync.py                                   # CPU, tiny preset
    python benchmarks/weight_sync.py --device cuda --shape qwen2-1.5b --dtype bf16
    python benchmarks/weight_sync.py --device cuda --ranks 2 --shape qwen2-1.5b --dtype bf16 \
        --trainers megatron_train --megatron-tp 2                      # TP2 -> 2 replicas
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from shapes import SHAPES

from posttrain.config.converter import CONVERTER
from posttrain.config.sections import (
    AlgorithmConfig,
    GeneratingArgs,
    ModelArgs,
    RoleConfig,
    StrategyArgs,
    TrainingArgs,
)
from posttrain.host.plugin_host import create_plugin_host
from posttrain.launch.base import GroupSpec
from posttrain.launch.local import LocalLauncher
from posttrain.weight_sync.transport import InProcessTransport, SharedMemoryTransport


def build_model(shape: str, out_dir: str, dtype: str) -> int:
    """A Qwen2-shaped model (random init, tied embeddings) saved in ``dtype``; its weight bytes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.backends.models import torch_dtype
    from posttrain.tasks.presets import build_tokenizer

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=True)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch_dtype(dtype))
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def spec(strategy, raw, role, model, dtype, ranks, device, run_dir) -> GroupSpec:
    config = CONVERTER.structure(raw, create_plugin_host().strategies()[strategy].config_class)
    return GroupSpec(
        role=role,
        config=RoleConfig(
            strategy_args=StrategyArgs(strategy_name=strategy, strategy_config=config),
            device_mapping=tuple(range(ranks)),
            model_args=ModelArgs(model_name_or_path=model, dtype=dtype),
            training_args=TrainingArgs(learning_rate=1e-5),
            generating_args=GeneratingArgs(),
        ),
        algorithm=AlgorithmConfig(),
        seed=1,
        run_dir=run_dir,
        base_dir=run_dir,
        device=device,
        threads=None if device == "cuda" else 1,
    )


def time_syncs(transport, source, target, repeats: int) -> tuple[float, dict, float]:
    """Median seconds per sync after one warm-up, the last sync's stats, driver calls per sync."""
    transport.run(source, target)
    launcher_calls = source.processes.calls + (
        0 if source.shares_processes_with(target) else target.processes.calls
    )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stats = transport.run(source, target)
        times.append(time.perf_counter() - start)
    calls = source.processes.calls + (
        0 if source.shares_processes_with(target) else target.processes.calls
    )
    return statistics.median(times), stats, (calls - launcher_calls) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--trainers", default="fsdp2_train,megatron_train")
    parser.add_argument("--megatron-tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()
    installed = create_plugin_host().strategies()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = build_model(args.shape, f"{tmp}/model", args.dtype)
        for trainer in args.trainers.split(","):
            if trainer not in installed:
                print(f"skipping {trainer}: not installed")
                continue
            raw = {"tensor_model_parallel_size": args.megatron_tp} if "megatron" in trainer else {}
            for layout, transport_cls in (
                ("hybrid (one process per rank)", InProcessTransport),
                ("separate processes per role", SharedMemoryTransport),
            ):
                specs = [
                    spec(
                        trainer,
                        raw,
                        "actor_train",
                        f"{tmp}/model",
                        args.dtype,
                        args.ranks,
                        args.device,
                        f"{tmp}/run",
                    ),
                    spec(
                        "hf_infer",
                        {},
                        "actor_infer",
                        f"{tmp}/model",
                        args.dtype,
                        args.ranks,
                        args.device,
                        f"{tmp}/run",
                    ),
                ]
                launcher = LocalLauncher(call_timeout_s=1200, start_timeout_s=1200)
                try:
                    if transport_cls is InProcessTransport:
                        groups = launcher.start_processes(specs)
                    else:
                        groups = {s.role: launcher.start_group(s) for s in specs}
                    transport = transport_cls(bucket_bytes=args.bucket_mb << 20)
                    seconds, stats, calls = time_syncs(
                        transport, groups["actor_train"], groups["actor_infer"], args.repeats
                    )
                finally:
                    launcher.shutdown()
                rows.append((trainer, layout, transport_cls.name, stats, seconds, calls))
    print(
        f"\nweight sync, {args.shape} ({model_bytes / 1e9:.3f} GB in {args.dtype}), "
        f"{args.ranks} rank(s) on {args.device}, -> hf_infer on the same devices"
    )
    header = ("trainer", "layout", "transport", "buckets", "s/sync", "GB/s", "calls/sync", "vs sep")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    separate = {r[0]: r[4] for r in rows if r[2] == SharedMemoryTransport.name}
    for trainer, layout, name, stats, seconds, calls in rows:
        ratio = separate.get(trainer, seconds) / seconds
        print(
            f"| {trainer} | {layout} | {name} | {stats['buckets']} | {seconds:.4f} | "
            f"{model_bytes / seconds / 1e9:.2f} | {calls:.0f} | {ratio:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
