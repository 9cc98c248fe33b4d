"""Per-step overhead of the ray launcher against the local launcher on the quickstart: both run
the same workflow for N steps in one invocation; prints mean step time (step 1 excluded),
worker start-up time, time outside the steps, and the ray/local ratios.

    python benchmarks/ray_vs_local.py [--steps 40] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(workflow: str, launcher: str, steps: int, extra: list[str], tmp: Path) -> dict:
    run_dir = tmp / launcher
    cmd = [sys.executable, "-m", "posttrain.cli", "run", workflow]
    sets = [
        f"trainer.output_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.save_steps=0",
        "trainer.save_final=false",
        "trainer.resume=never",
        "trainer.logger=[jsonl]",
        f"cluster.launcher={launcher}",
        *extra,
    ]
    for item in sets:
        cmd += ["--set", item]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{launcher} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    step_times = [m["time/step"] for m in metrics]
    started = sum(float(s) for s in re.findall(r"^started .*\(([\d.]+)s\)$", proc.stdout, re.M))
    return {
        "step": statistics.mean(step_times[1:]),
        "step_sd": statistics.pstdev(step_times[1:]),
        "startup": started,
        "outside": wall - sum(step_times),
        "wall": wall,
        "rewards": [m["reward/mean"] for m in metrics],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {
            name: run(args.workflow, name, args.steps, args.set, Path(tmp))
            for name in ("local", "ray")
        }
    local, ray = res["local"], res["ray"]
    print(f"quickstart, {args.steps} steps ({' '.join(args.set) or 'default settings'})")
    print(f"| {'':32} | {'local':>9} | {'ray':>9} | {'ray/local':>9} |")
    print(f"| {'-' * 32} | {'-' * 9} | {'-' * 9} | {'-' * 9} |")
    rows = [
        ("mean step time, step 1 excl. (s)", "step"),
        ("worker start-up (s)", "startup"),
        ("time outside steps (s)", "outside"),
        ("wall time (s)", "wall"),
    ]
    for label, key in rows:
        ratio = ray[key] / local[key] if local[key] else float("nan")
        print(f"| {label:32} | {local[key]:9.3f} | {ray[key]:9.3f} | {ratio:9.2f} |")
    print(f"step time sd: local {local['step_sd']:.3f} s, ray {ray['step_sd']:.3f} s")
    same = local["rewards"] == ray["rewards"]
    print(f"per-step rewards identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
