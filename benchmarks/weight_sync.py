"""Weight-sync throughput, trainer -> rollout: the hybrid engine's in-process hand-over and
separate processes per role on the same devices (shared memory through the driver), and the
disaggregated layout, where the rollout role has devices of its own (a broadcast from trainer
rank 0, NCCL on GPUs).

Effective GB/s = bytes of the model's weights in its dtype / wall time of the whole sync phase
(the transport's run, as the loop times it). Median of the timed syncs after one warm-up.

``--verify``: the syncs are timed once per ``trainer.weight_sync_verify`` mode, in the same
processes, and each mode's overhead is given against ``off``'s sync. ``every`` sums every bucket
of every sync, as ``first`` does in a run's first sync only; ``first``'s row is its later syncs
(one bucket each, in turn): the warm-up of the first mode timed is the processes' first sync.

    python benchmarks/weight_sync.py                                   # CPU, tiny preset
    python benchmarks/weight_sync.py --device cuda --shape qwen2-1.5b --dtype bf16
    python benchmarks/weight_sync.py --device cuda --ranks 2 --shape qwen2-1.5b --dtype bf16 \
        --trainers megatron_train --megatron-tp 2                      # TP2 -> 2 replicas
    python benchmarks/weight_sync.py --device cuda --shape qwen2-1.5b --dtype bf16 \
        --layouts disaggregated                                        # GPU 0 -> GPU 1
    python benchmarks/weight_sync.py --device cuda --shape qwen2-1.5b --dtype bf16 \
        --trainers fsdp2_train --verify off first every               # the check's cost
    python benchmarks/weight_sync.py --trainers fsdp2_train --repeats 1   # smoke check
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import statistics
import tempfile
import time

from common import SHAPES, build_model, print_table
from trainer_runs import role_spec

from posttrain.host.plugin_host import create_plugin_host
from posttrain.launch.local import LocalLauncher
from posttrain.weight_sync.transport import (
    BroadcastTransport,
    InProcessTransport,
    SharedMemoryTransport,
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


LAYOUTS = {
    "hybrid": ("hybrid (one process per rank)", InProcessTransport),
    "separate": ("separate processes per role", SharedMemoryTransport),
    "disaggregated": ("rollout on devices of its own", BroadcastTransport),
}


def built_bytes(args, path: str) -> int:
    """Build the model (on a GPU in a process of its own, whose CUDA context is gone before the
    ranks start: an 8B model takes minutes on the CPU) and return its bytes."""
    if args.device != "cuda":
        return build_model(args.shape, path, dtype=args.dtype, max_positions=8192).nbytes
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        job = pool.submit(
            build_model, args.shape, path, dtype=args.dtype, max_positions=8192, device="cuda"
        )
        return job.result().nbytes


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
    parser.add_argument(
        "--layouts",
        default="hybrid,separate",
        help=f"comma-separated, of: {', '.join(LAYOUTS)} (disaggregated: rollout on the "
        "devices after the trainer's)",
    )
    parser.add_argument(
        "--verify",
        nargs="+",
        default=["first"],
        choices=("off", "first", "every"),
        help="trainer.weight_sync_verify modes to time, in this order (default: first, the "
        "workflow's default)",
    )
    args = parser.parse_args()
    installed = create_plugin_host().strategies()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = built_bytes(args, f"{tmp}/model")
        settings = dict(
            devices=tuple(range(args.ranks)),
            model_dtype=args.dtype,
            device=args.device,
            threads=None if args.device == "cuda" else 1,
        )
        for trainer in args.trainers.split(","):
            if trainer not in installed:
                print(f"skipping {trainer}: not installed")
                continue
            raw = {"tensor_model_parallel_size": args.megatron_tp} if "megatron" in trainer else {}
            for layout in args.layouts.split(","):
                label, transport_cls = LAYOUTS[layout]
                rollout = settings
                if layout == "disaggregated":
                    rollout = {**settings, "devices": tuple(range(args.ranks, 2 * args.ranks))}
                specs = [
                    role_spec(
                        "actor_train", trainer, f"{tmp}/model", f"{tmp}/run", raw=raw, **settings
                    ),
                    role_spec("actor_infer", "hf_infer", f"{tmp}/model", f"{tmp}/run", **rollout),
                ]
                launcher = LocalLauncher(call_timeout_s=1200, start_timeout_s=1200)
                transport = transport_cls(bucket_bytes=args.bucket_mb << 20)
                try:
                    if transport_cls is InProcessTransport:
                        groups = launcher.start_processes(specs)
                    else:
                        groups = {s.role: launcher.start_group(s) for s in specs}
                    for verify in args.verify:
                        transport.verify = verify
                        seconds, stats, calls = time_syncs(
                            transport, groups["actor_train"], groups["actor_infer"], args.repeats
                        )
                        rows.append(
                            (trainer, label, transport_cls.name, verify, stats, seconds, calls)
                        )
                    transport.close(groups["actor_train"], groups["actor_infer"])
                finally:
                    launcher.shutdown()
    separate = {(r[0], r[3]): r[5] for r in rows if r[2] == SharedMemoryTransport.name}
    unchecked = {(r[0], r[2]): r[5] for r in rows if r[3] == "off"}
    print_table(
        [
            {
                "trainer": trainer,
                "layout": layout,
                "transport": name,
                "verify": verify,
                "buckets": stats["buckets"],
                # Buckets the rollout side checked in the last sync (the shared-memory
                # transport's imports do not say).
                "checked": stats.get("verified"),
                "s/sync": seconds,
                "GB/s": model_bytes / seconds / 1e9,
                "vs off": f"{(seconds / unchecked[trainer, name] - 1) * 100:+.1f}%"
                if (trainer, name) in unchecked
                else None,
                "calls/sync": f"{calls:.0f}",
                "vs sep": f"{separate.get((trainer, verify), seconds) / seconds:.1f}x",
            }
            for trainer, layout, name, verify, stats, seconds, calls in rows
        ],
        f"\nweight sync, {args.shape} ({model_bytes / 1e9:.3f} GB in {args.dtype}), "
        f"{args.ranks} rank(s) on {args.device} -> hf_infer",
        float_format=".2f",
        formats={"s/sync": ".4f"},
        text_columns=4,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
