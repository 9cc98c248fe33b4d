"""The speed mode of benchmarks/vs_trl.py (``--shape``): posttrain and TRL's GRPOTrainer one after
the other on one device, on the same random model of a shape, with the same prompts, batch,
lengths and hyperparameters: per-step time, tokens/s and start-up as ratios.

Both sides, every step: 16 prompts x 8 completions = 128 sequences of 16 prompt tokens (16 digits,
one token each) and 64 new tokens, forced (posttrain: ``generating_args.ignore_eos``; TRL:
``min_new_tokens``, which masks EOS until then); temperature 1, no top-p/top-k; one optimizer
step (one PPO epoch, one mini-batch: the old policy's log-probs cost no forward pass, rollout
log-probs in posttrain, TRL's detached current ones); AdamW at a constant lr 1e-6, no weight
decay, gradients clipped at 1.0; the k3 KL to a reference model in the loss, coefficient 0.001;
token-mean loss, advantages normalised by the group's std; the reward ``exact_match`` to "0"
(cheap; a random model never earns it, and the compute is the same). On cuda, bf16 compute over
float32 weights and optimizer state (posttrain: ``model_args.dtype: bf16``; TRL: bf16 autocast
over a float32 model); float32 on cpu. No gradient checkpointing. Training micro-batches of as
many rows on both sides: posttrain packs the step's rows under ``--max-tokens-per-micro-batch``;
TRL takes as many equal micro-batches (gradient accumulation), and the reference scores that many
rows per forward pass on both sides.

posttrain: the hybrid layout on device 0, one process: fsdp2_train, hf_infer rollout,
fsdp2_infer reference. TRL: its transformers ``generate`` path (no vLLM) on the policy it
trains, and a reference model it loads (float32, as its policy).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from common import build_model, device_name, print_table
from vs_trl_measures import fmt, ratio, step_times
from vs_trl_sides import default_trl_python, run_posttrain, run_trl, trl_version

PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
PROMPT_TOKENS = 16
NEW_TOKENS = 64
LEARNING_RATE = 1e-6
KL_COEF = 0.001
TEMPERATURE = 1.0
SEED = 42
WARMUP_STEPS = 1  # left out of the per-step medians (allocator, kernels' first launches)


def write_prompts(path: Path, count: int) -> None:
    """``count`` prompts of PROMPT_TOKENS random digits, each with the answer "0". The presets'
    tokenizer encodes a digit as one token and adds no special tokens: PROMPT_TOKENS tokens on
    both sides."""
    rng = random.Random(SEED)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            digits = "".join(rng.choice("0123456789") for _ in range(PROMPT_TOKENS))
            f.write(json.dumps({"prompt": digits, "answer": "0"}) + "\n")


def micro_batch_rows(completions: int, seq: int, max_tokens: int) -> int:
    """Rows per training micro-batch on both sides. posttrain splits the step's rows (all ``seq``
    tokens long) into the fewest balanced micro-batches under ``max_tokens``; TRL's are equal,
    so it takes the fewest equal ones that fit: the same rows wherever the budget's split is
    even (powers of two here)."""
    for count in range(1, completions + 1):
        if completions % count == 0 and completions // count * seq <= max_tokens:
            return completions // count
    return 1


def posttrain_workflow(
    model_dir: Path, prompts: Path, device: str, steps: int, max_tokens: int, ref_rows: int
) -> dict:
    return {
        "model_args": {
            "model_name_or_path": str(model_dir),
            # fsdp2_train keeps float32 master weights and computes in this dtype.
            "dtype": "bf16" if device == "cuda" else "fp32",
        },
        "data": {"path": str(prompts), "apply_chat_template": "never"},
        "algorithm": {
            "name": "grpo",
            "group_size": GROUP_SIZE,
            "rollout_batch_size": PROMPTS_PER_STEP,
            "norm_adv_by_std": True,
            "clip_ratio": 0.2,
            "clip_ratio_c": None,  # TRL has no dual clip
            "loss_agg_mode": "token-mean",
            "kl_coef": KL_COEF,
            "kl_estimator": "k3",
            "kl_mode": "loss",
            "ppo_epochs": 1,
            "num_mini_batches": 1,
            "old_logprobs": "rollout",
        },
        "actor_train": {
            "strategy_args": {"strategy_name": "fsdp2_train"},
            "device_mapping": [0],
            "training_args": {
                "learning_rate": LEARNING_RATE,
                "weight_decay": 0.0,
                "lr_scheduler_type": "constant",
                "warmup_steps": 0,
                "max_grad_norm": 1.0,
                "use_dynamic_batch_size": True,
                "max_tokens_per_micro_batch": max_tokens,
            },
        },
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": [0],
            # Every prompt of the step in one generate call, as TRL's generation batch.
            "infer_batch_size": PROMPTS_PER_STEP,
            "generating_args": {
                "max_new_tokens": NEW_TOKENS,
                "temperature": TEMPERATURE,
                "ignore_eos": True,
            },
        },
        "reference": {
            "strategy_args": {"strategy_name": "fsdp2_infer"},
            "device_mapping": [0],
            "infer_batch_size": ref_rows,
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "max_steps": steps,
            "save_steps": 0,
            "save_final": False,
            "logger": ["jsonl"],
            "resume": "never",
            "seed": SEED,
            "progress": False,
        },
        # One CPU thread per process on both sides (the TRL side sets its own).
        "cluster": {"device": device, "threads_per_worker": 1},
    }


def trl_arguments(
    model_dir: Path, prompts: Path, device: str, steps: int, micro_rows: int
) -> list[str]:
    return [
        "--model", str(model_dir), "--prompts", str(prompts), "--steps", str(steps),
        "--prompts-per-step", str(PROMPTS_PER_STEP), "--group-size", str(GROUP_SIZE),
        "--lr", str(LEARNING_RATE), "--beta", str(KL_COEF),
        "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--temperature", str(TEMPERATURE),
        "--micro-batch", str(micro_rows), "--device", device, "--seed", str(SEED),
        *(["--bf16"] if device == "cuda" else []),
    ]  # fmt: skip


def measures(result: dict) -> dict:
    """Median step times after the warm-up, tokens/s from them, and the mean completion length
    of the steady steps."""
    out = step_times(result, WARMUP_STEPS)
    lengths = [r["length"] for r in result["rows"][WARMUP_STEPS:]]
    out["length"] = statistics.mean(lengths)
    # Every prompt and completion token of the step.
    tokens = PROMPTS_PER_STEP * GROUP_SIZE * (PROMPT_TOKENS + out["length"])
    out["tokens_per_s"] = tokens / out["step"]
    out["wall"] = result["done"] - result["launch"]
    # posttrain's rows only; a phase some steps skip (a checkpoint's) is left out.
    steady = [r["phases"] for r in result["rows"][WARMUP_STEPS:] if "phases" in r]
    if steady:
        every = [k for k in steady[0] if all(k in p for p in steady)]
        out["phases"] = {k: statistics.median(p[k] for p in steady) for k in every}
    return out


def print_phases(phases: dict[str, float]) -> None:
    """posttrain's step by the loop's phases (``time/<phase>`` of its metrics), medians."""
    parts = [f"{key.removeprefix('time/')} {value:.3f}" for key, value in phases.items()]
    print(f"posttrain's step by phase, medians (s): {' | '.join(parts)}")


def print_speed(totals: dict[str, dict], steps: int) -> None:
    names = {"posttrain": "posttrain", "trl": "TRL"}
    both = len(totals) == 2
    rows = []
    for label, key, spec, compare in [
        (f"per-step time, median of steps {WARMUP_STEPS + 1}-{steps} (s)", "step", ".3f", True),
        ("step's own time, median (s)", "step_own", ".3f", True),
        ("tokens/s (prompt + completion tokens / step time)", "tokens_per_s", ",.0f", True),
        ("start-up: launch to step 1 (s)", "startup", ".1f", True),
        ("wall time, launch to exit (s)", "wall", ".1f", True),
        ("completion tokens per sample, mean", "length", ".1f", False),
    ]:
        row = {"": label, **{names[side]: fmt(t[key], spec) for side, t in totals.items()}}
        if both:
            a, b = totals["posttrain"][key], totals["trl"][key]
            row["pt/TRL"] = ratio(a, b) if compare else ""
        rows.append(row)
    print_table(rows)
    if both:
        print("pt/TRL: below 1 for times, above 1 for tokens/s, is posttrain faster")


def run(args) -> int:
    """The speed mode with vs_trl.py's parsed arguments."""
    if args.steps <= WARMUP_STEPS:
        sys.exit(f"--steps must exceed the {WARMUP_STEPS} warm-up step")
    sides = [s for s in ("posttrain", "trl") if args.only in (None, s)]
    trl_python = args.trl_python or default_trl_python()
    version = trl_version(trl_python) if "trl" in sides else "-"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="posttrain-vs-trl-speed-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    # Built on the host and saved in the compute dtype, as a checkpoint would come; each side
    # loads it in the dtypes it keeps (float32 for the trained weights).
    params = build_model(
        args.shape, str(model_dir), dtype="bf16" if args.device == "cuda" else "fp32"
    ).params
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, PROMPTS_PER_STEP * args.steps)  # no prompt twice
    budget = args.max_tokens_per_micro_batch
    rows = micro_batch_rows(PROMPTS_PER_STEP * GROUP_SIZE, PROMPT_TOKENS + NEW_TOKENS, budget)

    totals: dict[str, dict] = {}
    for side in sides:
        side_dir = work / side
        if side_dir.exists():
            shutil.rmtree(side_dir)
        side_dir.mkdir()
        print(f"{side}: {args.steps} steps on {args.device}", flush=True)
        if side == "posttrain":
            spec = posttrain_workflow(model_dir, prompts, args.device, args.steps, budget, rows)
            workflow = side_dir / "vs_trl_speed.yaml"
            workflow.write_text(yaml.safe_dump(spec, sort_keys=False))
            result = run_posttrain(side_dir, workflow, args.set)
        else:
            side_args = trl_arguments(model_dir, prompts, args.device, args.steps, rows)
            result = run_trl(side_dir, trl_python, side_args)
        totals[side] = measures(result)
    (work / "summary.json").write_text(json.dumps(totals, indent=2))

    size = f"{params / 1e9:.2f}B params" if params >= 1e8 else f"{params / 1e6:.2f}M params"
    sides_text = " vs ".join(f"TRL {version}" if side == "trl" else side for side in totals)
    compute = "bf16 compute over float32 weights" if args.device == "cuda" else "float32"
    print(
        f"\n{sides_text}: {args.shape} ({size}, random init), "
        f"{device_name(args.device)}, {compute}; {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} "
        f"completions a step, {PROMPT_TOKENS} + {NEW_TOKENS} tokens each, one optimizer step "
        f"in micro-batches of {rows} rows, KL {KL_COEF} to a reference, lr {LEARNING_RATE:g}; "
        f"{args.steps} steps, the first a warm-up"
    )
    if args.set:
        print(f"posttrain overrides: {' '.join(args.set)}")
    print_speed(totals, args.steps)
    if "phases" in totals.get("posttrain", {}):
        print_phases(totals["posttrain"]["phases"])
    print(f"model, workflow, logs and per-step metrics: {work}")
    return 0
