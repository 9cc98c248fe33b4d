"""Time per phase of the quickstart (rollout, reward, log-probs, values, training, weight sync,
checkpoint, and the driver's time outside the phases), driver calls per step, steps/s and
tokens/s, printed as a table; with ``--baseline``, the same for a second workflow measured in the
same run, and the step-time ratio (e.g. PPO's critic cost against GRPO).

    python benchmarks/quickstart.py [--steps 100] [--save-steps 25] [--workflow WORKFLOW.yaml]
    python benchmarks/quickstart.py --workflow examples/quickstart_ppo.yaml \
        --baseline examples/quickstart.yaml --set trainer.save_steps=0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


def measure(workflow: str, args) -> tuple[list[dict], float]:
    """Run ``workflow``; its per-step metrics and the wall time of the whole command."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "posttrain.cli", "run", workflow]
        overrides = [
            f"trainer.output_dir={run_dir}",
            f"trainer.max_steps={args.steps}",
            f"trainer.save_steps={args.save_steps}",
            "trainer.resume=never",
            "trainer.logger=[jsonl]",
            *args.set,
        ]
        for item in overrides:
            cmd += ["--set", item]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            raise SystemExit(proc.returncode)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines], wall


def steady_step(metrics: list[dict]) -> float:
    steady = metrics[1:] if len(metrics) > 1 else metrics  # step 1 warms caches up
    return statistics.mean(m["time/step"] for m in steady)


def report(workflow: str, metrics: list[dict], wall: float, steps: int) -> None:
    steady = metrics[1:] if len(metrics) > 1 else metrics
    loop_time = sum(m["time/step"] for m in metrics)
    tokens = sum(m["perf/tokens_per_s"] * m["time/step"] for m in metrics)
    print(f"quickstart benchmark: {steps} steps, {Path(workflow).name}")
    print(f"{'phase':<12} {'ms/step':>9} {'ms/call':>9} {'share':>7}")
    for phase in PHASES:
        values = [m.get(f"time/{phase}", 0.0) for m in steady]
        per_call = [v for v in values if v > 0]
        print(
            f"{phase:<12} {1000 * statistics.mean(values):>9.1f} "
            f"{1000 * statistics.mean(per_call) if per_call else 0.0:>9.1f} "
            f"{100 * sum(values) / sum(m['time/step'] for m in steady):>6.1f}%"
        )
    print(f"{'step':<12} {1000 * steady_step(metrics):>9.1f}")
    calls = statistics.mean(m.get("driver/calls", 0.0) for m in steady)
    print(f"driver calls/step     {calls:.1f} (one per rank called)")
    print(f"steps/s (loop)        {len(metrics) / loop_time:.2f}")
    print(f"tokens/s (loop)       {tokens / loop_time:.0f}")
    print(f"start-up + teardown   {wall - loop_time:.1f} s")
    print(f"wall time             {wall:.1f} s")
    last = metrics[-10:]
    print(f"reward, last 10 steps {sum(m['reward/mean'] for m in last) / len(last):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--baseline", help="a second workflow to compare step times with")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    args = parser.parse_args()
    metrics, wall = measure(args.workflow, args)
    report(args.workflow, metrics, wall, args.steps)
    if args.baseline:
        base_metrics, base_wall = measure(args.baseline, args)
        print()
        report(args.baseline, base_metrics, base_wall, args.steps)
        ratio = steady_step(metrics) / steady_step(base_metrics)
        print(
            f"\nstep time {Path(args.workflow).name} / {Path(args.baseline).name}: {ratio:.2f}x "
            f"({1000 * steady_step(metrics):.1f} ms vs {1000 * steady_step(base_metrics):.1f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
