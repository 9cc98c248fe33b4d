"""The measures of benchmarks/vs_trl.py: each side's per-step rewards and step-end times turned
into step times, start-up and time to the reward threshold, their medians over repeats, and the
printed comparison."""

from __future__ import annotations

import itertools
import statistics

from common import print_table

WARMUP_STEPS = 5  # steps left out of the steady-state per-step time (caches, allocator, JIT)


def step_times(side: dict, warmup: int) -> dict:
    """Medians over the steps after the first ``warmup``: ``step``, the wall time from the end
    of the step before to the step's own end (everything the loop does, logging included), and
    ``step_own``, the time the side itself counts for the step; ``startup``, from the side's
    launch to its first step's begin."""
    rows = side["rows"]
    # The interval ending at step k (1-based) is at index k - 2.
    intervals = [b["end"] - a["end"] for a, b in itertools.pairwise(rows)][max(warmup - 1, 0) :]
    own = [r["own"] for r in rows][warmup:]
    return {
        "step": statistics.median(intervals) if intervals else float("nan"),
        "step_own": statistics.median(own) if own else float("nan"),
        "startup": rows[0]["begin"] - side["launch"],
    }


def summarize(side: dict, threshold: float, window: int) -> dict:
    rows = side["rows"]
    ends = [r["end"] for r in rows]
    rewards = [r["reward"] for r in rows]
    first_begin = rows[0]["begin"]
    out = {
        **step_times(side, WARMUP_STEPS),
        "loop": ends[-1] - first_begin,
        "wall": side["done"] - side["launch"],
        "steps": len(rows),
        "reward_first": statistics.mean(rewards[:window]),
        "reward_last": statistics.mean(rewards[-window:]),
        "hit_step": None,
        "hit_loop": None,
        "hit_wall": None,
    }
    for k in range(window, len(rows) + 1):
        if statistics.mean(rewards[k - window : k]) >= threshold:
            out["hit_step"] = k
            out["hit_loop"] = rows[k - 1]["end"] - first_begin
            out["hit_wall"] = rows[k - 1]["end"] - side["launch"]
            break
    return out


def fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def ratio(a, b) -> str:
    return "-" if a is None or b is None or not b or a != a or b != b else f"{a / b:.2f}x"


KEYS = (
    "step",
    "step_own",
    "startup",
    "hit_step",
    "hit_loop",
    "hit_wall",
    "loop",
    "wall",
    "reward_first",
    "reward_last",
)


def aggregate(runs: list[dict]) -> dict:
    """The median over repeats of every measure; a threshold never reached counts as missing."""
    out = {}
    for key in KEYS:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["hits"] = sum(r["hit_step"] is not None for r in runs)
    return out


def print_summary(totals: dict[str, dict], args, info: dict, trl_version: str) -> None:
    """The medians of each side that ran, side by side, with their ratios when both ran."""
    names = {"posttrain": "posttrain", "trl": "TRL"}
    both = len(totals) == 2
    repeats = f", median of {args.repeats} runs per side" if args.repeats > 1 else ""
    sides = " vs ".join(f"TRL {trl_version}" if side == "trl" else side for side in totals)
    print(
        f"\n{sides}: single_digit_addition, {info['parameters'] / 1e6:.2f}M-"
        f"parameter Qwen2, warm start reward {info['expected_reward']:.3f}, 64 completions/step, "
        f"lr 1e-4, one thread per process, {args.steps} steps{repeats}"
    )
    if args.set:
        print(f"posttrain overrides: {' '.join(args.set)}")
    measures = [
        (f"wall time per step, median after step {WARMUP_STEPS} (s)", "step", ".4f"),
        ("step's own time, median (s)", "step_own", ".4f"),
        ("start-up: launch to step 1 (s)", "startup", ".1f"),
        (f"steps to rolling({args.window}) reward >= {args.threshold}", "hit_step", ".0f"),
        ("time to threshold, from step 1 (s)", "hit_loop", ".2f"),
        ("time to threshold, from launch (s)", "hit_wall", ".1f"),
        ("loop time, all steps (s)", "loop", ".1f"),
        ("wall time, launch to exit (s)", "wall", ".1f"),
        (f"reward, first {args.window} steps", "reward_first", ".3f"),
        (f"reward, last {args.window} steps", "reward_last", ".3f"),
    ]
    rows = []
    for label, key, spec in measures:
        row = {"": label, **{names[side]: fmt(t[key], spec) for side, t in totals.items()}}
        if both:
            a, b = totals["posttrain"][key], totals["trl"][key]
            row["pt/TRL"] = ratio(a, b) if not key.startswith("reward") else ""
        rows.append(row)
    print_table(rows)
    if not both:
        return
    pt, trl = totals["posttrain"], totals["trl"]
    if pt["hits"] < args.repeats or trl["hits"] < args.repeats:
        print(
            f"threshold reached in {pt['hits']}/{args.repeats} posttrain runs, "
            f"{trl['hits']}/{args.repeats} TRL runs (medians over those that reached it)"
        )
    print(
        f"goals: time to threshold <= 0.50x TRL's (now {ratio(pt['hit_wall'], trl['hit_wall'])} "
        f"from launch, {ratio(pt['hit_loop'], trl['hit_loop'])} from step 1); per step <= 1.00x "
        f"(now {ratio(pt['step'], trl['step'])})"
    )


def print_runs(summaries: dict[str, list[dict]]) -> None:
    print("per run: s/step, start-up (s), to threshold: steps / s from step 1 / s from launch")
    for side, runs in summaries.items():
        for run in runs:
            print(
                f"  {side:<9} seed {run['seed']}: {fmt(run['step'], '.4f')}  "
                f"{fmt(run['startup'], '.1f')}  {fmt(run['hit_step'], 'd')} / "
                f"{fmt(run['hit_loop'], '.2f')} / {fmt(run['hit_wall'], '.1f')}"
            )
