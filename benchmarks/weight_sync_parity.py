"""After a training step and a weight sync, how far apart are the rollout engine's log-probs of
its own samples and the trainer's log-probs of the same tokens? Prints a table per transport.

    python benchmarks/weight_sync_parity.py [--trainer fsdp2_train] [--ranks 2] [--rollout NAME]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

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
from posttrain.protocol import concat_tensor_rows
from posttrain.tasks.presets import preset_path
from posttrain.testing.expected import max_sample_logprob_diff, samples_batch, synthetic_train_batch
from posttrain.weight_sync.transport import BroadcastTransport, SharedMemoryTransport


def start(launcher, strategy: str, ranks: int, devices: tuple[int, ...], role: str, tmp: str):
    spec = create_plugin_host().strategies()[strategy]
    config = CONVERTER.structure({}, spec.config_class)
    role_config = RoleConfig(
        strategy_args=StrategyArgs(strategy_name=strategy, strategy_config=config),
        device_mapping=devices,
        world_size=ranks,
        model_args=ModelArgs(model_name_or_path=preset_path("preset:tiny-qwen2")),
        training_args=TrainingArgs(learning_rate=1e-2),
        generating_args=GeneratingArgs(),
    )
    return launcher.start_group(
        GroupSpec(
            role=role,
            config=role_config,
            algorithm=AlgorithmConfig(),
            seed=1,
            run_dir=tmp,
            base_dir=tmp,
            device="cpu",
            threads=1,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
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
                        (
                            transport_cls.name,
                            step + 1,
                            stats["buckets"],
                            stats["bytes"] / 2**20,
                            sync_s * 1000,
                            max_sample_logprob_diff(out, got),
                        )
                    )
                rollout.shutdown()
        finally:
            launcher.shutdown()
    print(f"{args.trainer} x{args.ranks} -> {args.rollout}: log-prob parity after each sync")
    header = ("transport", "step", "buckets", "MiB", "sync ms", "max |dlogp|")
    print("{:<14} {:>4} {:>7} {:>6} {:>8} {:>12}".format(*header))
    for name, step, buckets, mib, ms, diff in rows:
        print(f"{name:<14} {step:>4} {buckets:>7} {mib:>6.2f} {ms:>8.1f} {diff:>12.2e}")


if __name__ == "__main__":
    main()
