"""Time per phase of the quickstart (rollout, reward, log-probs, training, weight sync,
checkpoint, and the driver's time outside the phases), driver calls per step, steps/s and
tokens/s, printed as a table.

    python benchmarks/quickstart.py [--steps 100] [--save-steps 25] [--workflow WORKFLOW.yaml]
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
    "train",
    "weight_sync",
    "checkpoint",
    "outside_phases",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "posttrain.cli",
            "run",
            args.workflow,
            "--set",
            f"trainer.output_dir={run_dir}",
            "--set",
            f"trainer.max_steps={args.steps}",
            "--set",
            f"trainer.save_steps={args.save_steps}",
            "--set",
            "trainer.resume=never",
            "--set",
            "trainer.logger=[jsonl]",
        ]
        for item in args.set:
            cmd += ["--set", item]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
    steady = metrics[1:] if len(metrics) > 1 else metrics  # step 1 warms caches up
    loop_time = sum(m["time/step"] for m in metrics)
    tokens = sum(m["perf/tokens_per_s"] * m["time/step"] for m in metrics)
    rows = []
    for phase in PHASES:
        values = [m.get(f"time/{phase}", 0.0) for m in steady]
        per_call = [v for v in values if v > 0]
        rows.append(
            (
                phase,
                1000 * statistics.mean(values),
                1000 * statistics.mean(per_call) if per_call else 0.0,
                100 * sum(values) / sum(m["time/step"] for m in steady),
            )
        )
    print(f"quickstart benchmark: {args.steps} steps, {Path(args.workflow).name}")
    print(f"{'phase':<12} {'ms/step':>9} {'ms/call':>9} {'share':>7}")
    for phase, per_step, per_call, share in rows:
        print(f"{phase:<12} {per_step:>9.1f} {per_call:>9.1f} {share:>6.1f}%")
    print(f"{'step':<12} {1000 * statistics.mean(m['time/step'] for m in steady):>9.1f}")
    calls = statistics.mean(m.get("driver/calls", 0.0) for m in steady)
    print(f"driver calls/step     {calls:.1f} (one per rank called)")
    print(f"steps/s (loop)        {len(metrics) / loop_time:.2f}")
    print(f"tokens/s (loop)       {tokens / loop_time:.0f}")
    print(f"start-up + teardown   {wall - loop_time:.1f} s")
    print(f"wall time             {wall:.1f} s")
    last = metrics[-10:]
    print(f"reward, last 10 steps {sum(m['reward/mean'] for m in last) / len(last):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
