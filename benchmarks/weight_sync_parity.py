"""After a training step and a weight sync, how far apart are the rollout engine's log-probs of
its own samples and the trainer's log-probs of the same tokens? Prints a table per transport.

    python benchmarks/weight_sync_parity.py [--trainer fsdp2_train] [--ranks 2] [--rollout NAME]
    python benchmarks/weight_sync_parity.py --ranks 1 --steps 1            # smoke check
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import print_table
from trainer_runs import role_spec

from posttrain.launch.local import LocalLauncher
from posttrain.protocol import concat_tensor_rows
from posttrain.tasks.presets import preset_path
from posttrain.testing.expected import max_sample_logprob_diff, samples_batch, synthetic_train_batch
from posttrain.weight_sync.transport import BroadcastTransport, SharedMemoryTransport


def start(launcher, strategy: str, ranks: int, devices: tuple[int, ...], role: str, tmp: str):
    """``role`` on ``preset:tiny-qwen2``, one thread per rank, learning rate 1e-2 (a step moves
    the weights far enough for a stale sync to show)."""
    spec = role_spec(
        role,
        strategy,
        preset_path("preset:tiny-qwen2"),
        tmp,
        devices=devices,
        ranks=ranks,
        learning_rate=1e-2,
        seed=1,
        threads=1,
    )
    return launcher.start_group(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", default="fsdp2_train")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rollout", default="hf_infer")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from posttrain.testing.contract import StrategyContract

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        launcher = LocalLauncher()
        try:
            trainer = start(
                launcher, args.trainer, args.ranks, tuple(range(args.ranks)), "actor_train", tmp
            )
            for transport_cls, devices in (
                (SharedMemoryTransport, (0,)),
                (BroadcastTransport, (args.ranks,)),
            ):
                rollout = start(
                    launcher,
                    args.rollout,
                    1,
                    devices,
                    "actor_infer",
                    os.path.join(tmp, transport_cls.name),
                )
                transport = transport_cls(bucket_bytes=1 << 20)
                for step in range(args.steps):
                    batch = synthetic_train_batch(seed=step, dp_size=trainer.dp_size)
                    trainer.call_dp("train_step", batch.split(trainer.dp_size))
                    start_s = time.perf_counter()
                    stats = transport.run(trainer, rollout)
                    sync_s = time.perf_counter() - start_s
                    out = StrategyContract._generate(None, rollout, n=4, max_new_tokens=8)
                    sb = samples_batch(out)
                    per = len(sb) // trainer.dp_size
                    shares = [
                        sb.select(list(range(i * per, (i + 1) * per)))
                        for i in range(trainer.dp_size)
                    ]
                    got = concat_tensor_rows(trainer.call_dp("compute_logprobs", shares))
                    rows.append(
                        {
                            "transport": transport_cls.name,
                            "step": step + 1,
                            "buckets": stats["buckets"],
                            "MiB": stats["bytes"] / 2**20,
                            "sync ms": f"{sync_s * 1000:.1f}",
                            "max abs dlogp": f"{max_sample_logprob_diff(out, got):.2e}",
                        }
                    )
                rollout.shutdown()
        finally:
            launcher.shutdown()
    print_table(
        rows,
        f"{args.trainer} x{args.ranks} -> {args.rollout}: log-prob parity after each sync",
        float_format=".2f",
    )


if __name__ == "__main__":
    main()
