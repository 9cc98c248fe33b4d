"""posttrain against Hugging Face TRL's GRPOTrainer, side by side in one run, in two modes: how
fast each learns the tiny addition task on CPU (the default), and how fast each runs an RL step
of a real shape on one GPU (``--shape``). Each reports its measures as ratios.

    benchmarks/trl_env.sh .venv-trl        # once: TRL in its own virtual environment
    nice -n 5 python benchmarks/vs_trl.py [--steps 150] [--threshold 0.65] [--window 10]
        [--repeats 3] [--trl-python .venv-trl/bin/python] [--set KEY=VALUE ...]
    python benchmarks/vs_trl.py --only posttrain --steps 6 --window 1 --repeats 1 \
        --sft-steps 1                                        # smoke check (no TRL needed)
    python3 benchmarks/vs_trl.py --device cuda --shape qwen2-1.5b [--steps 6] \
        [--max-tokens-per-micro-batch 16384]                 # speed mode, one GPU
    python benchmarks/vs_trl.py --shape tiny --device cpu --steps 3   # its smallest setting

The learning mode: both sides start from the same locally built model: a ~0.5M-parameter Qwen2
over the arithmetic alphabet (posttrain.tasks.presets' builder, hidden 128, 2 layers), given a
short supervised warm start (plain torch, deterministic) that teaches the format more than the
sums: after "a+b=" it emits a digit, the right one a little more often than the others (see
``warm_start``). Then GRPO on the 55 problems of ``single_digit_addition`` with the
``exact_match`` reward: 8 prompts x 8 samples = 64 completions and one optimizer step per RL
step, lr 1e-4, temperature 1, one new token, no KL, one thread per process. posttrain runs
benchmarks/vs_trl.yaml through ``posttrain run`` (fsdp2_train + hf_infer on device [0]) in this
environment; TRL runs benchmarks/trl_grpo_side.py in its venv. The sides run one after the other,
never at once, ``--repeats`` times each in alternating order; each process's per-step rewards and
step-end times give the measures (``vs_trl_measures.summarize``).

The speed mode (benchmarks/vs_trl_speed.py says what both sides run): one random model of the
shape, 16 prompts x 8 completions of 16 + 64 tokens a step, KL to a reference, each side once;
per-step time and tokens/s (medians of the steps after the first), start-up. TRL runs in
``--trl-python``: .venv-trl's where it exists, else this interpreter. On a GPU machine with no
network that is posttrain's own Python, with TRL's pure-Python wheels installed apart
(``pip install --no-deps --target DIR``) and put on PYTHONPATH: trl 1.16.0, datasets 4.8.5,
dill 0.4.1, multiprocess 0.70.19 (datasets 5.x fingerprints a dataset in a way that needs
pyarrow >= 24; 4.8.5 runs with pyarrow 21, the oldest TRL takes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import vs_trl_speed
from common import REPO, SHAPES, copy_tokenizer
from vs_trl_measures import WARMUP_STEPS, aggregate, print_runs, print_summary, summarize
from vs_trl_sides import default_trl_python, run_posttrain, run_trl, trl_version

WORKFLOW = REPO / "benchmarks" / "vs_trl.yaml"


# --- the shared starting point -------------------------------------------------------------------


def warm_start(out_dir: Path, sft_steps: int, answer_weight: float, seed: int) -> dict:
    """Build the ~0.5M-parameter Qwen2 and give it a short SFT on the task's format.

    The target after each prompt "a+b=" is a distribution over the ten digits: ``answer_weight``
    on the right sum and the rest spread evenly over all ten digits (weight 0.1: expected
    starting reward ~0.19; 0 would be the format only, chance reward, which lr 1e-4 needs over 400
    steps to leave; SFT on the sums themselves reaches 0.98 within 100 steps and would leave RL
    nothing to learn). Full batch of all 55 prompts, AdamW lr 1e-3,
    ``sft_steps`` steps, one thread, fixed seed: the same weights on every run of this machine.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from posttrain.tasks.data import synthetic_single_digit_addition
    from posttrain.tasks.presets import Preset, build_preset, build_tokenizer

    preset = Preset(
        hidden_size=128,
        num_hidden_layers=2,
        seed=seed,
        description="Qwen2, hidden 128, 2 layers, arithmetic alphabet (~0.5M parameters)",
    )
    hf_logging.disable_progress_bar()
    base = out_dir.with_name(out_dir.name + "-init")
    build_preset(preset, str(base))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tokenizer = build_tokenizer()
    records = synthetic_single_digit_addition()
    ids = torch.tensor([tokenizer(r["prompt"])["input_ids"] for r in records])
    answers = torch.tensor([tokenizer(r["answer"])["input_ids"][0] for r in records])
    digits = torch.tensor([tokenizer(str(d))["input_ids"][0] for d in range(10)])
    target = torch.zeros(len(records), model.config.vocab_size)
    target[:, digits] = (1.0 - answer_weight) / len(digits)
    target[torch.arange(len(records)), answers] += answer_weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    start = time.perf_counter()
    model.train()
    for _ in range(sft_steps):
        logits = model(input_ids=ids).logits[:, -1].float()
        loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_seconds": time.perf_counter() - start,
        "sft_loss": float(loss.detach()),
        # The expected exact_match reward at temperature 1 over the 55 prompts.
        "expected_reward": float(probs.gather(1, answers[:, None]).mean()),
        "p_digit": float(probs[:, digits].sum(-1).mean()),
    }
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer(base, out_dir)  # as the preset builder wrote it
    shutil.rmtree(base)
    return info


# --- the two sides -------------------------------------------------------------------------------


def run_posttrain_side(
    work: Path, model_dir: Path, steps: int, seed: int, extra: list[str]
) -> dict:
    sets = [
        f"model_args.model_name_or_path={model_dir}",
        f"trainer.max_steps={steps}",
        f"trainer.seed={seed}",
        *extra,
    ]
    return run_posttrain(work, WORKFLOW, sets)


def run_trl_side(
    work: Path, model_dir: Path, prompts: Path, steps: int, seed: int, trl_python: str
) -> dict:
    side_args = [
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--steps",
        str(steps),
        "--prompts-per-step",
        "8",
        "--group-size",
        "8",
        "--lr",
        "1e-4",
        "--seed",
        str(seed),
    ]
    return run_trl(work, trl_python, side_args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="the speed mode, on a random model of this shape (default: the learning mode)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="the speed mode's device (the learning mode runs on CPU)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="RL steps per run (default: 150; the speed mode: 6, the first a warm-up)",
    )
    parser.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=16384,
        help="the speed mode: posttrain's training micro-batch budget; TRL's micro-batches hold "
        "as many rows (16384: all 128 sequences of 80 tokens in one)",
    )
    parser.add_argument("--threshold", type=float, default=0.65, help="rolling reward to reach")
    parser.add_argument(
        "--window",
        type=int,
        default=10,
        help="steps in the rolling mean (10: 640 completions; one step's reward has a standard "
        "error of ~0.06-0.08 near 0.65 from 64 samples in 8 correlated groups, a 10-step mean "
        "~0.02-0.03, so one lucky batch cannot cross the threshold, and the lag, ~5 steps, stays "
        "small next to the ~50-60 steps the default warm start needs)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per side, alternating which side goes first, RL seeds 42, 43, ...; the table "
        "shows medians (this machine is shared: one run's timings swing by 1.5x)",
    )
    parser.add_argument(
        "--trl-python",
        default=None,
        help="the Python that runs TRL's side (default: .venv-trl/bin/python if it exists, else "
        "this interpreter)",
    )
    parser.add_argument("--set", action="append", default=[], help="posttrain workflow overrides")
    parser.add_argument("--sft-steps", type=int, default=100, help="warm-start SFT steps")
    parser.add_argument(
        "--sft-answer-weight",
        type=float,
        default=0.1,
        help="weight of the right sum in the SFT target, the rest spread over the ten digits "
        "(0.1: expected starting reward ~0.19; 0: chance, 0.1, too slow for lr 1e-4; 0.25: "
        "~0.32, over the threshold within ~20 steps)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model init and SFT seed")
    parser.add_argument("--work-dir", default=None, help="keep model, logs and metrics here")
    parser.add_argument("--only", choices=["posttrain", "trl"], default=None, help="run one side")
    args = parser.parse_args()
    if args.shape:
        args.steps = args.steps or 6
        return vs_trl_speed.run(args)
    if args.device != "cpu":
        parser.error("the learning mode runs on CPU; --device cuda goes with --shape")
    args.steps = args.steps or 150
    if args.steps <= max(args.window, WARMUP_STEPS):
        parser.error("--steps must exceed --window and the warm-up steps")
    trl_python = args.trl_python or default_trl_python()
    version = trl_version(trl_python) if args.only != "posttrain" else "-"

    import torch

    torch.set_num_threads(1)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="posttrain-vs-trl-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "warm_start"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    info = warm_start(model_dir, args.sft_steps, args.sft_answer_weight, args.seed)
    print(
        f"warm start: {info['parameters']:,} parameters, {args.sft_steps} SFT steps in "
        f"{info['sft_seconds']:.1f} s, P(digit) {info['p_digit']:.3f}, expected reward "
        f"{info['expected_reward']:.3f} -> {model_dir}"
    )
    from posttrain.tasks.data import synthetic_single_digit_addition

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in synthetic_single_digit_addition()))

    sides = [s for s in ("posttrain", "trl") if args.only in (None, s)]
    summaries: dict[str, list[dict]] = {side: [] for side in sides}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        seed = 42 + r
        run_dir = work / f"run{r}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir()
        for side in sides if r % 2 == 0 else sides[::-1]:
            print(
                f"run {r + 1}/{args.repeats}: {side}, {args.steps} steps, seed {seed}", flush=True
            )
            if side == "posttrain":
                result = run_posttrain_side(run_dir, model_dir, args.steps, seed, args.set)
            else:
                result = run_trl_side(run_dir, model_dir, prompts, args.steps, seed, trl_python)
            summaries[side].append({"seed": seed, **summarize(result, args.threshold, args.window)})
    load_after = os.getloadavg()
    totals = {side: aggregate(runs) for side, runs in summaries.items()}
    (work / "summary.json").write_text(
        json.dumps({"warm_start": info, "runs": summaries, "medians": totals}, indent=2)
    )
    print_runs(summaries)
    print_summary(totals, args, info, version)
    print(
        f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after, on "
        f"{os.cpu_count()} CPUs; model, logs and per-step metrics: {work}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
