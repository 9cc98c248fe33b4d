"""Time per phase of the quickstart (rollout, reward, log-probs, values, training, weight sync,
checkpoint, and the driver's time outside the phases), driver calls per step, steps/s and
tokens/s, printed as a table; with ``--baseline``, the same for a second workflow measured in the
same run, and the step-time ratio (e.g. PPO's critic cost against GRPO).

    python benchmarks/quickstart.py [--steps 100] [--save-steps 25] [--workflow WORKFLOW.yaml]
    python benchmarks/quickstart.py --workflow examples/quickstart_ppo.yaml \
        --baseline examples/quickstart.yaml --set trainer.save_steps=0
    python benchmarks/quickstart.py --tiny --steps 1 --save-steps 0      # smoke check
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import QUICKSTART, TINY_QUICKSTART, print_table, run_workflow, steady, steady_step_s

# "outside_phases": step time no phase accounts for (the driver's own work between phases).
PHASES = (
    "rollout",
    "reward",
    "logprobs",
    "values",
    "train",
    "weight_sync",
    "checkpoint",
    "outside_phases",
)


def overrides(args) -> list[str]:
    return [
        f"trainer.max_steps={args.steps}",
        f"trainer.save_steps={args.save_steps}",
        *(TINY_QUICKSTART if args.tiny else ()),
        *args.set,
    ]


def report(workflow: str, metrics: list[dict], wall: float, steps: int) -> None:
    steady_metrics = steady(metrics)
    steady_time = sum(m["time/step"] for m in steady_metrics)
    loop_time = sum(m["time/step"] for m in metrics)
    tokens = sum(m["perf/tokens_per_s"] * m["time/step"] for m in metrics)
    rows = []
    for phase in PHASES:
        values = [m.get(f"time/{phase}", 0.0) for m in steady_metrics]
        per_call = [v for v in values if v > 0]
        rows.append(
            {
                "phase": phase,
                "ms/step": 1000 * statistics.mean(values),
                "ms/call": 1000 * statistics.mean(per_call) if per_call else 0.0,
                "share": f"{100 * sum(values) / steady_time:.1f}%",
            }
        )
    rows.append({"phase": "step", "ms/step": 1000 * steady_step_s(metrics)})
    print_table(
        rows, f"quickstart benchmark: {steps} steps, {Path(workflow).name}", float_format=".1f"
    )
    calls = statistics.mean(m.get("driver/calls", 0.0) for m in steady_metrics)
    print(f"driver calls/step     {calls:.1f} (one per rank called)")
    print(f"steps/s (loop)        {len(metrics) / loop_time:.2f}")
    print(f"tokens/s (loop)       {tokens / loop_time:.0f}")
    print(f"start-up + teardown   {wall - loop_time:.1f} s")
    print(f"wall time             {wall:.1f} s")
    last = metrics[-10:]
    print(f"reward, last 10 steps {sum(m['reward/mean'] for m in last) / len(last):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(QUICKSTART))
    parser.add_argument("--baseline", help="a second workflow to compare step times with")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    parser.add_argument("--tiny", action="store_true", help="a smoke check: one rank, 4x2 samples")
    args = parser.parse_args()
    run = run_workflow(args.workflow, overrides(args))
    report(args.workflow, run.metrics, run.wall_s, args.steps)
    if args.baseline:
        base = run_workflow(args.baseline, overrides(args))
        print()
        report(args.baseline, base.metrics, base.wall_s, args.steps)
        step_s, base_step_s = steady_step_s(run.metrics), steady_step_s(base.metrics)
        print(
            f"\nstep time {Path(args.workflow).name} / {Path(args.baseline).name}: "
            f"{step_s / base_step_s:.2f}x ({1000 * step_s:.1f} ms vs {1000 * base_step_s:.1f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
