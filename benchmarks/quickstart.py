"""Time per phase of the quickstart (rollout, reward, log-probs, values, training, weight sync,
checkpoint, and the driver's time outside the phases), driver calls per step, steps/s and
tokens/s, printed as a table; with ``--baseline``, the same for a second workflow measured in the
same run, and the step-time ratio (e.g. PPO's critic cost against GRPO); with ``--base REF``,
the same workflow on the code of git revision ``REF`` (checked out in a temporary worktree and put
first on PYTHONPATH), measured in the same run: is this tree's quickstart slower than REF's?

    python benchmarks/quickstart.py [--steps 100] [--save-steps 25] [--workflow WORKFLOW.yaml]
    python benchmarks/quickstart.py --workflow examples/quickstart_ppo.yaml \
        --baseline examples/quickstart.yaml --set trainer.save_steps=0
    python benchmarks/quickstart.py --base main~10 --steps 100 --repeats 2   # code vs code
    python benchmarks/quickstart.py --tiny --steps 1 --save-steps 0 --base HEAD   # smoke check

``--base`` runs the installed distributions (their entry points) with REF's modules: REF must
have the same plugin packages as this tree. Runs alternate (base, this tree, base, ...) so that a
machine's drift reaches both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from common import (
    QUICKSTART,
    REPO,
    TINY_QUICKSTART,
    print_table,
    run_workflow,
    steady,
    steady_step_s,
)

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


@contextlib.contextmanager
def checked_out(ref: str) -> Iterator[Path]:
    """A detached git worktree of this repository at ``ref``, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        git = ["git", "-C", str(REPO)]
        subprocess.run([*git, "worktree", "add", "--detach", "-q", str(tree), ref], check=True)
        try:
            yield tree
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=True)


def code_env(tree: Path) -> dict[str, str]:
    """This process's environment with ``tree``'s core and plugins first on PYTHONPATH."""
    paths = [tree / "core", *sorted(p for p in (tree / "plugins").iterdir() if p.is_dir())]
    rest = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*map(str, paths), *([rest] if rest else [])]),
    }


def compare_with_base(args) -> None:
    """The workflow on REF's code and on this tree's, alternating, ``--repeats`` times each."""
    workflow = Path(args.workflow).resolve()
    here, base = [], []
    with checked_out(args.base) as tree:
        base_workflow = (
            tree / workflow.relative_to(REPO) if workflow.is_relative_to(REPO) else workflow
        )
        for _ in range(args.repeats):
            base.append(run_workflow(base_workflow, overrides(args), env=code_env(tree)))
            here.append(run_workflow(workflow, overrides(args), env=code_env(REPO)))
    report(args.workflow, here[-1].metrics, here[-1].wall_s, args.steps)
    print()
    rows = []
    for name, runs in ((f"base ({args.base})", base), ("this tree", here)):
        steps = [steady_step_s(run.metrics) for run in runs]
        rewards = [statistics.mean(m["reward/mean"] for m in run.metrics[-10:]) for run in runs]
        rows.append(
            {
                "code": name,
                "ms/step": 1000 * statistics.mean(steps),
                "min ms/step": 1000 * min(steps),
                "wall s": statistics.mean(run.wall_s for run in runs),
                "reward last 10": statistics.mean(rewards),
            }
        )
    rows.append(
        {
            "code": "this tree / base",
            "ms/step": rows[1]["ms/step"] / rows[0]["ms/step"],
            "min ms/step": rows[1]["min ms/step"] / rows[0]["min ms/step"],
            "wall s": rows[1]["wall s"] / rows[0]["wall s"],
        }
    )
    print_table(
        rows,
        f"quickstart, this tree against {args.base}: {args.steps} steps, "
        f"{args.repeats} run(s) each, {workflow.name}",
        float_format=".3f",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workflow", default=str(QUICKSTART))
    parser.add_argument("--baseline", help="a second workflow to compare step times with")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    parser.add_argument("--tiny", action="store_true", help="a smoke check: one rank, 4x2 samples")
    parser.add_argument("--base", help="a git revision: its code runs the same workflow too")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side with --base")
    args = parser.parse_args()
    if args.base:
        compare_with_base(args)
        return 0
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
