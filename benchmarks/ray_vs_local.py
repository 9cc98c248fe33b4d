"""Per-step overhead of the ray launcher against the local launcher on the quickstart: both run
the same workflow for N steps in one invocation; prints mean step time (step 1 excluded),
worker start-up time, time outside the steps, and the ray/local ratios.

    python benchmarks/ray_vs_local.py [--steps 40] [--set KEY=VALUE ...]
    python benchmarks/ray_vs_local.py --tiny --steps 1                  # smoke check
"""

from __future__ import annotations

import argparse
import os
import re
import statistics

from common import QUICKSTART, TINY_QUICKSTART, print_table, run_workflow, steady


def run(workflow: str, launcher: str, steps: int, extra: list[str]) -> dict:
    overrides = [
        f"trainer.max_steps={steps}",
        "trainer.save_steps=0",
        "trainer.save_final=false",
        f"cluster.launcher={launcher}",
        *extra,
    ]
    result = run_workflow(workflow, overrides, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    step_times = [m["time/step"] for m in steady(result.metrics)]
    started = sum(float(s) for s in re.findall(r"^started .*\(([\d.]+)s\)$", result.stdout, re.M))
    return {
        "step": statistics.mean(step_times),
        "step_sd": statistics.pstdev(step_times),
        "startup": started,
        "outside": result.wall_s - sum(m["time/step"] for m in result.metrics),
        "wall": result.wall_s,
        "rewards": [m["reward/mean"] for m in result.metrics],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(QUICKSTART))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    parser.add_argument("--tiny", action="store_true", help="a smoke check: one rank, 4x2 samples")
    args = parser.parse_args()
    extra = [*(TINY_QUICKSTART if args.tiny else ()), *args.set]
    local, ray = (run(args.workflow, name, args.steps, extra) for name in ("local", "ray"))
    labels = {
        "mean step time, step 1 excl. (s)": "step",
        "worker start-up (s)": "startup",
        "time outside steps (s)": "outside",
        "wall time (s)": "wall",
    }
    print_table(
        [
            {
                "": label,
                "local": local[key],
                "ray": ray[key],
                "ray/local": f"{ray[key] / local[key]:.2f}" if local[key] else "nan",
            }
            for label, key in labels.items()
        ],
        f"quickstart, {args.steps} steps ({' '.join(extra) or 'default settings'})",
    )
    print(f"step time sd: local {local['step_sd']:.3f} s, ray {ray['step_sd']:.3f} s")
    same = local["rewards"] == ray["rewards"]
    print(f"per-step rewards identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
