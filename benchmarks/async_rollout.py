"""Synchronous rollout against asynchronous rollout (``algorithm.max_staleness: 1``) on a
disaggregated layout: the trainer and the reference on device 0, the rollout engine on device 1.
The same workflow runs twice in one invocation; the table gives the steady step time, steps per
hour, each side's idle time per step and the final reward, and the ratios async / sync.

    python benchmarks/async_rollout.py                       # CPU: the quickstart's tiny task
    python benchmarks/async_rollout.py --device cuda --shape qwen2-1.5b --max-new-tokens 64 \
        --steps 12 --rollout-batch-size 16                   # 2 GPUs, a 1.5B-shaped model
    python benchmarks/async_rollout.py --shape tiny --steps 1 --rollout-batch-size 4 \
        --set algorithm.group_size=2                         # smoke check
    python benchmarks/async_rollout.py --max-new-tokens 8 --partial-segment 2
                                 # also async with partial rollouts, segments of 2 tokens

With ``--partial-segment N`` a third run is asynchronous with ``algorithm.partial_rollout``
(segments of N new tokens), and the table adds the ratios partial / async. Partial rollouts
need generations longer than a segment: set ``--max-new-tokens`` above N. hf_infer's
``infer_batch_size`` counts prompts and a continued sample is a prompt of its own: pass
``--set actor_infer.infer_batch_size=R`` with R the step's samples (rollout batch x group
size), so later segments decode in one batch as the first does (a no-op for the other modes).

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

# max_staleness of each mode, and its extra overrides ("partial" only with --partial-segment)
MODES = {"sync": (0, []), "async": (1, []), "partial": (1, ["algorithm.partial_rollout=true"])}


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
        "token_staleness": statistics.mean(
            m.get("rollout/token_staleness_mean", m.get("async/staleness", 0.0))
            for m in steady_metrics
        ),
        "partial_frac": statistics.mean(m.get("rollout/partial_frac", 0.0) for m in steady_metrics),
        "reward_last": statistics.mean(m["reward/mean"] for m in last),
    }


def ratios(row: dict[str, float], base: dict[str, float]) -> dict[str, str]:
    return {k: f"{row[k] / base[k]:.2f}" if base[k] else "nan" for k in base}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(QUICKSTART))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape")
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument(
        "--partial-segment",
        type=int,
        help="also run async with partial rollouts, segments of this many new tokens",
    )
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
        for mode, (staleness, extra) in MODES.items():
            if mode == "partial":
                if not args.partial_segment:
                    continue
                extra = [*extra, f"algorithm.partial_rollout_segment_tokens={args.partial_segment}"]
            sets = [*overrides(args, model), f"algorithm.max_staleness={staleness}", *extra]
            results[mode] = summary(run_workflow(args.workflow, sets).metrics)

    print(
        f"\nasync rollout benchmark: {args.steps} steps, {args.device}, "
        f"{args.shape or 'quickstart preset'}, {args.rollout_batch_size} prompts/step, "
        f"{args.max_new_tokens} new tokens"
        + (f", partial: segments of {args.partial_segment}" if args.partial_segment else "")
        + "; trainer on device 0, rollout on device 1"
    )
    pairs = [("async", "sync"), ("partial", "async")]
    print_table(
        [
            *({"": mode, **row} for mode, row in results.items()),
            *(
                {"": f"{a} / {b}", **ratios(results[a], results[b])}
                for a, b in pairs
                if a in results
            ),
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
