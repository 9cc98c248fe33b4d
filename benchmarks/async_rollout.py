"""Synchronous rollout against asynchronous rollout (``algorithm.max_staleness: 1``) on a
disaggregated layout: the trainer and the reference on device 0, the rollout engine on device 1.
The same workflow runs twice in one invocation; the table gives the steady step time, steps per
hour, each side's idle time per step and the final reward, and the ratios async / sync.

    python benchmarks/async_rollout.py                       # CPU: the quickstart's tiny task
    python benchmarks/async_rollout.py --device cuda --shape qwen2-1.5b --max-new-tokens 64 \
        --steps 12 --rollout-batch-size 16                   # 2 GPUs, a 1.5B-shaped model
    python benchmarks/async_rollout.py --shape tiny --steps 1 --rollout-batch-size 4 \
        --set algorithm.group_size=2                         # smoke check

``--shape`` builds a randomly initialised Qwen2 of that shape (benchmarks/common.py) with the
quickstart's tokenizer: it measures speed, not learning. Without it the quickstart's preset
learns, and the final rewards of both modes say whether one-step staleness costs reward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import QUICKSTART, SHAPES, build_model, print_table, run_workflow, steady

MODES = {"sync": 0, "async": 1}  # max_staleness


def overrides(args, model: str | None) -> list[str]:
    sets = [
        f"trainer.max_steps={args.steps}",
        "trainer.save_steps=0",  # measure rollout and training, not checkpoints
        "trainer.save_final=false",
        f"algorithm.rollout_batch_size={args.rollout_batch_size}",
        f"actor_infer.generating_args.max_new_tokens={args.max_new_tokens}",
        "actor_train.device_mapping=[0]",
        "reference.device_mapping=[0]",
        "actor_infer.device_mapping=[1]",
        f"cluster.device={args.device}",
        *args.set,
    ]
    if model:
        # A billion-parameter shape: every sample of a step generated in one batch, and train
        # micro-batches that fit one GPU with the vocabulary's logits (measured on an H100).
        sets += [
            f"model_args.model_name_or_path={model}",
            "actor_infer.infer_batch_size=128",
            "reference.infer_batch_size=128",
            "actor_train.training_args.per_device_train_batch_size=16",
        ]
        if args.device == "cuda":
            sets.append("model_args.dtype=bf16")
    return sets


def summary(metrics: list[dict]) -> dict[str, float]:
    steady_metrics = steady(metrics)
    step = statistics.mean(m["time/step"] for m in steady_metrics)
    last = metrics[-max(1, len(metrics) // 5) :]
    return {
        "step_s": step,
        "steps_per_hour": 3600 / step,
        "trainer_idle_s": statistics.mean(m["idle/trainer_s"] for m in steady_metrics),
        "rollout_idle_s": statistics.mean(m["idle/rollout_s"] for m in steady_metrics),
        "staleness": statistics.mean(m.get("async/staleness", 0.0) for m in steady_metrics),
        "reward_last": statistics.mean(m["reward/mean"] for m in last),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(QUICKSTART))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape")
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if args.shape:
            model = str(Path(tmp) / args.shape)
            dtype = "bf16" if args.device == "cuda" else "fp32"
            params = build_model(args.shape, model, dtype=dtype).params
            print(f"model: {args.shape}, {params / 1e9:.2f}B parameters, random weights")
        results = {}
        for mode, staleness in MODES.items():
            sets = [*overrides(args, model), f"algorithm.max_staleness={staleness}"]
            results[mode] = summary(run_workflow(args.workflow, sets).metrics)

    print(
        f"\nasync rollout benchmark: {args.steps} steps, {args.device}, "
        f"{args.shape or 'quickstart preset'}, {args.rollout_batch_size} prompts/step, "
        f"{args.max_new_tokens} new tokens; trainer on device 0, rollout on device 1"
    )
    ratios = {
        k: results["async"][k] / results["sync"][k] if results["sync"][k] else float("nan")
        for k in results["sync"]
    }
    print_table(
        [
            *({"": mode, **row} for mode, row in results.items()),
            {"": "async / sync", **{k: f"{v:.2f}" for k, v in ratios.items()}},
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
