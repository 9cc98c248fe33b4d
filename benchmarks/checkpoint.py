"""Checkpoint saves through posttrain: how long the training loop is blocked (stall) and how
fast the files are written in the background, for fsdp2_train and megatron_train, against the
disk's own speed measured with a plain file copy in the same run.

    python benchmarks/checkpoint.py --device cpu  --shape qwen2-100m
    python benchmarks/checkpoint.py --device cuda --shape qwen2-1.5b --dtype bf16
    python benchmarks/checkpoint.py --shape tiny --seq 32 --strategies fsdp2_train  # smoke check

One rank per trainer, a model built locally (random init), one optimizer step first so the
optimizer state is saved too. Per trainer: a synchronous save (``trainer.async_save: false``,
the whole save blocks the loop), then two background saves through the driver's
``CheckpointSaver``, the code path ``posttrain run`` uses. The first background save allocates
the host buffers; the second reuses them and is the one reported (one checkpoint kept, so the
disk needs room for about three). ``write GB/s`` is the bytes of
the checkpoint over the time from the end of the stall to the checkpoint being complete (files
fsynced, manifest written, renamed), measured with nothing else running; ``step s`` and ``step
s (saving)`` are a train step alone and one taken right after a background save began.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from common import SHAPES, build_model, print_table
from trainer_runs import random_train_batch, trainer_group

GB = 1e9


def strategy_config(strategy: str, dtype: str) -> tuple[dict, str]:
    """(strategy_config, model_args.dtype): bf16 compute over float32 master weights."""
    if strategy == "fsdp2_train":
        return ({"param_dtype": dtype} if dtype != "fp32" else {}), "fp32"
    return {}, dtype


def disk_copy_rate(checkpoint: str, scratch: str) -> float:
    """GB/s of a plain copy of the checkpoint's files (read from page cache, written and
    fsynced to the same disk), the yardstick for the background write."""
    total = 0
    start = time.perf_counter()
    for root, _, files in os.walk(checkpoint):
        for name in files:
            src = os.path.join(root, name)
            dst = os.path.join(scratch, f"{len(os.listdir(scratch))}-{name}")
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                shutil.copyfileobj(fin, fout, 16 << 20)
                fout.flush()
                os.fsync(fout.fileno())
            total += os.path.getsize(src)
    return total / GB / (time.perf_counter() - start)


def measure(args, model_dir: str, strategy: str) -> dict:
    from posttrain.checkpoint.saver import CheckpointSaver
    from posttrain.launch.local import LocalLauncher

    raw, model_dtype = strategy_config(strategy, args.dtype)
    run_dir = tempfile.mkdtemp(prefix=f"ckpt-{strategy}-", dir=args.dir)
    launcher = LocalLauncher()
    try:
        group = trainer_group(
            launcher,
            strategy,
            {"micro_batch_size": args.batch, **raw},
            model_dir,
            run_dir,
            model_dtype=model_dtype,
            device=args.device,
        )
        batch = random_train_batch(args.batch, args.seq, dp_size=1)

        def step() -> float:
            start = time.perf_counter()
            group.call_dp("train_step", [batch])
            return time.perf_counter() - start

        step()
        step_alone = step()

        def saver(background: bool) -> CheckpointSaver:
            return CheckpointSaver(
                run_dir, {"actor_train": group}, {"actor_train": strategy}, {}, 1,
                background=background, saved=lambda path, manifest: None,
                record=b"",  # no workflow to record: the record file is written empty
            )  # fmt: skip

        sync = saver(False)
        start = time.perf_counter()
        sync.save(1, {"step": 1}, {})
        sync_s = time.perf_counter() - start
        background = saver(True)
        background.save(2, {"step": 2}, {})
        first_stall = background.stats["stall_s"]
        background.wait()
        background.save(3, {"step": 3}, {})
        begun = time.perf_counter()
        background.wait()
        write_s = time.perf_counter() - begun
        stats = dict(background.stats)
        scratch = tempfile.mkdtemp(prefix="copy-", dir=args.dir)
        disk = disk_copy_rate(os.path.join(run_dir, "checkpoint-3"), scratch)
        shutil.rmtree(scratch)
        background.save(4, {"step": 4}, {})
        step_saving = step()
        background.wait()
    finally:
        launcher.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "sync_s": sync_s,
        "first_stall_s": first_stall,
        "stall_s": stats["stall_s"],
        "write_s": write_s,
        "bytes": stats["bytes"],
        "disk": disk,
        "step": step_alone,
        "step_saving": step_saving,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="qwen2-100m", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--strategies", default="fsdp2_train+megatron_train")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: cwd)")
    args = parser.parse_args()
    args.dir = os.path.abspath(args.dir or os.getcwd())
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as model_dir:
        params = build_model(args.shape, model_dir, dtype=args.dtype).params
        for strategy in args.strategies.split("+"):
            results[strategy] = measure(args, model_dir, strategy)
    rows = []
    for strategy, r in results.items():
        rate = r["bytes"] / GB / r["write_s"]
        rows.append(
            {
                "strategy": strategy,
                "GB saved": r["bytes"] / GB,
                "sync save s": r["sync_s"],
                "stall s (1st)": r["first_stall_s"],
                "stall s": r["stall_s"],
                "write s": r["write_s"],
                "write GB/s": rate,
                "disk copy GB/s": r["disk"],
                "write / disk": rate / r["disk"],
                "step s": r["step"],
                "step s (saving)": r["step_saving"],
            }
        )
    print_table(
        rows,
        f"checkpoint saves: {args.shape} ({params / 1e6:.0f}M params), {args.device} x 1, "
        f"{args.dtype}, checkpoints in {args.dir}",
        float_format=".2f",
        formats={"stall s": ".3f", "step s": ".3f", "step s (saving)": ".3f"},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
