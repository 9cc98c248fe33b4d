"""Does memory stay flat over a long run? Each ``memory/*`` figure of the step log (each phase's
peak GPU memory, the largest rank process's and the driver's resident memory) at an early steady
step against the last step: the growth in GiB and %, its trend over the steps between, and whether
the run's memory watch (posttrain.trainer.memory_watch) warned.

The workload is rl_step.py's hybrid GRPO step (its workflow, built the same way: a random model of
``--shape`` from its config, no download); ``--workflow`` runs a workflow file instead (the
quickstart on the CPU: resident memory only, no GPU peaks).

    python benchmarks/memory_flat.py --device cuda --shape qwen2-1.5b --steps 200 \
        --decode cuda_graph                                              # 1 GPU
    python benchmarks/memory_flat.py --workflow examples/quickstart.yaml --device cpu \
        --steps 2000                                                     # resident memory
    python benchmarks/memory_flat.py --shape tiny --device cpu --steps 6 # CPU smoke check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from common import device_name, print_table, run_workflow
from rl_step import (
    PHASES,
    WORKLOADS,
    add_workload_arguments,
    built_params,
    default_workload,
    workflow,
    write_prompts,
)

# The step whose figures are the baseline, when the run has steps after it: the memory watch's
# settling steps (5) are over, and so are the first steps' one-off allocations.
BASELINE_STEP = 10
WARNING = "warning: memory/"


def rl_step_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` completed with rl_step.py's defaults for what this script does not ask:
    rl_step.workflow reads them."""
    defaults = dict(
        layout="hybrid",
        gpus=None,
        rollout_gpus=1,
        reference=None,
        max_tokens=16384,
        micro_batch=None,
        checkpointing="auto",
        logprob_chunk_tokens=None,
    )
    return argparse.Namespace(**{**defaults, **vars(args)})


def grpo_workflow(args: argparse.Namespace, tmp: Path) -> tuple[Path, int]:
    """rl_step.py's GRPO workflow of ``args`` written into ``tmp`` (a random model of
    ``args.shape``, enough distinct prompts for every step), and the model's parameters."""
    args = rl_step_args(args)
    model = tmp / args.shape
    params = built_params(args, str(model), "bf16" if args.device == "cuda" else "fp32")
    prompts, _, prompt_len, _ = WORKLOADS[args.workload]
    data = tmp / "prompts.jsonl"
    write_prompts(data, prompts * max(args.steps, 1), prompt_len)
    spec = workflow(args, str(model), data)
    if args.decode != "auto":
        spec["actor_infer"]["strategy_args"]["strategy_config"] = {"decode": args.decode}
    path = tmp / "grpo.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, params


def baseline_index(metrics: list[dict]) -> int:
    """The index of the baseline step: BASELINE_STEP where the run goes past it, else the first
    steady step (the second)."""
    steps = [m["step"] for m in metrics]
    if BASELINE_STEP in steps and steps.index(BASELINE_STEP) < len(steps) - 1:
        return steps.index(BASELINE_STEP)
    return min(1, len(steps) - 1)


def figure_order(key: str) -> tuple[int, str]:
    """Phase peaks in the step's order, then the resident memories."""
    phase = key.removeprefix("memory/").removesuffix("_peak_gib")
    return (PHASES.index(phase) if phase in PHASES else len(PHASES), key)


def memory_rows(metrics: list[dict]) -> list[dict]:
    first = baseline_index(metrics)
    base, last = metrics[first], metrics[-1]
    keys = sorted({k for m in metrics for k in m if k.startswith("memory/")}, key=figure_order)
    rows = []
    for key in keys:
        series = [(m["step"], m[key]) for m in metrics[first:] if key in m]
        if not series or key not in base or key not in last:
            continue
        top_step, top = max(series, key=lambda s: s[1])
        growth = last[key] - base[key]
        # The least-squares trend from the baseline on: a last step that happens to be high or
        # low says less than the slope over every step.
        slope = (
            statistics.linear_regression([s for s, _ in series], [v for _, v in series]).slope
            if len(series) > 2
            else None
        )
        rows.append(
            {
                "figure": key.removeprefix("memory/"),
                f"step {base['step']} GiB": base[key],
                f"step {last['step']} GiB": last[key],
                "max GiB (step)": f"{top:.3f} ({top_step})",
                "growth GiB": growth,
                "growth %": growth / base[key] * 100 if base[key] else None,
                "trend GiB/100 steps": slope * 100 if slope is not None else None,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, shape="qwen2-1.5b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--workflow",
        help="run this workflow file (e.g. examples/quickstart.yaml) instead of the GRPO "
        "workload; --shape, --workload, --trainer and --decode are then unused",
    )
    args = parser.parse_args()
    args.workload = default_workload(args)

    overrides = [f"trainer.max_steps={args.steps}", f"cluster.device={args.device}", *args.set]
    with tempfile.TemporaryDirectory() as tmp:
        if args.workflow:
            path, what = Path(args.workflow).resolve(), args.workflow
        else:
            path, params = grpo_workflow(args, Path(tmp))
            what = (
                f"{args.shape} ({params / 1e9:.2f}B), {args.workload} workload, hybrid, "
                f"{args.trainer}, decode {args.decode}"
            )
        run = run_workflow(path, overrides)

    warnings = [line.strip() for line in run.stdout.splitlines() if WARNING in line]
    step_s = statistics.median(m["time/step"] for m in run.metrics)
    print(
        f"\nmemory over {len(run.metrics)} steps: {what}, {device_name(args.device)}; "
        f"{run.wall_s:.0f} s in all, median step {step_s:.2f} s"
    )
    print_table(memory_rows(run.metrics), formats={"growth %": ".1f"})
    print(f"\nmemory watch warned: {'yes' if warnings else 'no'}")
    for line in warnings:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
