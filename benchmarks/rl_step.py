"""The whole RL step at a real shape, phase by phase, against the hardware.

One GRPO workflow (old-policy log-probs recomputed by the trainer, a reference, forced response
lengths) runs for ``--steps`` steps; the first warms up and is left out. One table gives, per
phase: seconds, tokens, TFLOP/s per GPU (and the share of the GPU's bf16 peak), peak GPU memory;
the rollout's decode tokens/s; the weight sync's GB/s; and for the whole step, steps per hour and
tokens/s per GPU (every prompt and response token of the step, over the step's time and the GPUs
the layout uses: the figure NeMo-RL publishes).

FLOPs count 2 N per token for a forward pass and 6 N for a training pass (N: parameters, the tied
embedding once), plus causal attention (:func:`common.flops_per_token`); the log-prob phase runs
two forward passes (old policy, reference) over every token, the update one training pass.

    python benchmarks/rl_step.py --device cuda --shape qwen2-1.5b --workload short \
        --layout hybrid --trainer fsdp2_train --steps 6            # 1 GPU
    python benchmarks/rl_step.py --device cuda --shape qwen2-1.5b --workload long \
        --layout disaggregated --trainer megatron_train --profile  # 2 GPUs, profiles written
    python benchmarks/rl_step.py --shape tiny --workload tiny --steps 2   # CPU smoke check
    python benchmarks/rl_step.py --device cuda --shape qwen2-1.5b --logprob-chunk-tokens 0
                                        # full-vocabulary logits, to compare with the default

Workloads: ``short`` (16 prompts x 8, 16-token prompts, 64 new tokens), ``long`` (32 prompts x
8, 256-token prompts, 1024 new tokens) and ``tiny`` (2 prompts x 2, 8 + 4 tokens). Layouts:
``hybrid`` (every role on GPU 0, one process), ``disaggregated`` (trainer and reference on GPU
0, rollout on GPU 1), ``colocated`` (every role on GPUs 0 and 1). ``--profile`` writes the
top 15 operations of each phase's second call (benchmarks/phase_profiler.py) and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from common import (
    SHAPES,
    build_model,
    device_name,
    flops_per_token,
    peak_bf16_tflops,
    print_table,
    run_workflow,
    steady,
)

HERE = Path(__file__).resolve().parent
# prompts per step, samples per prompt, prompt tokens, new tokens
WORKLOADS = {
    "short": (16, 8, 16, 64),
    "long": (32, 8, 256, 1024),
    "tiny": (2, 2, 8, 4),
}
LAYOUTS = {  # (trainer and reference devices, rollout devices)
    "hybrid": ([0], [0]),
    "disaggregated": ([0], [1]),
    "colocated": ([0, 1], [0, 1]),
}
INFER_OF = {
    "fsdp2_train": "fsdp2_infer",
    "megatron_train": "megatron_infer",
    "deepspeed_train": "deepspeed_infer",
}
PHASES = ("rollout", "logprobs", "train", "weight_sync")


def write_prompts(path: Path, count: int, length: int) -> None:
    """``count`` distinct prompts of exactly ``length`` tokens of the presets' tokenizer (one
    character, one token): digits, which every preset tokenizer has."""
    with open(path, "w") as f:
        for i in range(count):
            digits = (str(i) * length)[:length] if i else "1" * length
            f.write(json.dumps({"prompt": digits, "answer": "0"}) + "\n")


def workflow(args, model: str, data: Path) -> dict:
    prompts, group, prompt_len, new_tokens = WORKLOADS[args.workload]
    train_devices, infer_devices = LAYOUTS[args.layout]
    cuda = args.device == "cuda"
    # Micro-batches by tokens (dynamic batching) unless --micro-batch fixes their rows; the
    # reference scores as many whole rows as the budget holds.
    rows = max(1, args.max_tokens // (prompt_len + new_tokens))
    batching = (
        {"per_device_train_batch_size": args.micro_batch}
        if args.micro_batch
        else {"use_dynamic_batch_size": True, "max_tokens_per_micro_batch": args.max_tokens}
    )
    # Chunked log-probs (fsdp2 / deepspeed strategies) unless the flag says otherwise.
    chunking = (
        {}
        if args.logprob_chunk_tokens is None
        else {"logprob_chunk_tokens": args.logprob_chunk_tokens}
    )
    return {
        "model_args": {
            "model_name_or_path": model,
            "dtype": "bf16" if cuda else "fp32",
            "disable_gradient_checkpointing": not args.checkpointing,
        },
        "data": {
            "path": str(data),
            "apply_chat_template": "never",
            "max_prompt_length": prompt_len + 8,
            "shuffle": False,
        },
        "algorithm": {
            "name": "grpo",
            "group_size": group,
            "rollout_batch_size": prompts,
            "kl_coef": 0.001,
            # Both scoring forwards run (old policy and reference), as asynchronous or
            # multi-epoch runs need.
            "old_logprobs": "recompute",
        },
        "actor_train": {
            "strategy_args": {"strategy_name": args.trainer, "strategy_config": chunking},
            "device_mapping": train_devices,
            "training_args": {"learning_rate": 1e-6, **batching},
        },
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": infer_devices,
            "infer_batch_size": prompts,
            "generating_args": {"max_new_tokens": new_tokens, "ignore_eos": True},
        },
        "reference": {
            "strategy_args": {
                "strategy_name": args.reference or INFER_OF[args.trainer],
                "strategy_config": dict(chunking),
            },
            "device_mapping": train_devices,
            "infer_batch_size": args.micro_batch or rows,
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "max_steps": args.steps,
            "save_steps": 0,
            "save_final": False,
            "progress": False,
            "seed": 42,
        },
        "cluster": {"device": args.device},
    }


def phase_rows(args, metrics: list[dict], params: int) -> list[dict]:
    prompts, group, prompt_len, _ = WORKLOADS[args.workload]
    gpus = len(set(LAYOUTS[args.layout][0]) | set(LAYOUTS[args.layout][1]))
    peak = peak_bf16_tflops(device_name(args.device))
    steps = steady(metrics)

    def mean(key: str) -> float:
        return statistics.mean(m.get(key, 0.0) for m in steps)

    samples = prompts * group
    response = mean("response/length_mean") * samples
    tokens = samples * prompt_len + response  # every token of the step's sequences
    seq = prompt_len + response / samples
    forward = flops_per_token(args.shape, params, int(seq), training=False)
    training = flops_per_token(args.shape, params, int(seq), training=True)
    # Rollout: the prompts' prefill and one forward per new token (attention over the prefix).
    work = {
        "rollout": (tokens, tokens * forward),
        "logprobs": (2 * tokens, 2 * tokens * forward),
        "train": (tokens, tokens * training),
        "weight_sync": (0.0, 0.0),
    }
    trainer_gpus = len(LAYOUTS[args.layout][0])
    rows = []
    for phase in PHASES:
        seconds = mean(f"time/{phase}")
        count, flops = work[phase]
        busy = gpus if args.layout == "colocated" else trainer_gpus
        tflops = flops / seconds / busy / 1e12 if seconds else 0.0
        row = {
            "phase": phase,
            "s": seconds,
            "tokens": count,
            "TFLOP/s/GPU": tflops,
            "of peak": tflops / peak if peak else None,
            "peak GiB": mean(f"memory/{phase}_peak_gib") or None,
            # The slowest rank's seconds in the phase's hooks: the rest is the driver's.
            "on ranks s": mean(f"rank_time/{phase}_s") or None,
            "other": "",
        }
        if phase == "rollout" and seconds:
            row["other"] = f"{response / seconds:,.0f} new tokens/s"
        if phase == "weight_sync" and seconds:
            gb = mean("weight_sync/mb") * 2**20 / 1e9
            row["other"] = f"{gb:.2f} GB, {gb / seconds:.1f} GB/s"
        rows.append(row)
    step = mean("time/step")
    rows.append(
        {
            "phase": "step",
            "s": step,
            "tokens": tokens,
            "TFLOP/s/GPU": None,
            "of peak": None,
            "peak GiB": None,
            "on ranks s": None,
            "other": f"{3600 / step:,.0f} steps/h, {tokens / step / gpus:,.0f} tokens/s/GPU",
        }
    )
    return rows


def _seconds(metrics: dict, phase: str) -> str:
    return f"{metrics.get(f'time/{phase}', 0):.2f} / {metrics.get(f'rank_time/{phase}_s', 0):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    parser.add_argument("--layout", default="hybrid", choices=sorted(LAYOUTS))
    parser.add_argument("--trainer", default="fsdp2_train", choices=sorted(INFER_OF))
    parser.add_argument("--reference", help="the reference's strategy (default: the trainer's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--max-tokens", type=int, default=16384, help="tokens per micro-batch (dynamic batching)"
    )
    parser.add_argument("--micro-batch", type=int, help="rows per micro-batch instead of tokens")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of each phase")
    parser.add_argument(
        "--logprob-chunk-tokens",
        type=int,
        help="strategy_config.logprob_chunk_tokens of the trainer and the reference (fsdp2 and "
        "deepspeed strategies; 0: full-vocabulary logits); default: the strategies' own",
    )
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    args = parser.parse_args()
    if args.logprob_chunk_tokens is not None and "megatron" in args.trainer + str(args.reference):
        parser.error("--logprob-chunk-tokens: megatron strategies compute log-probs their own way")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = tmp_path / args.shape
        dtype = "bf16" if args.device == "cuda" else "fp32"
        params = build_model(args.shape, str(model), dtype=dtype, max_positions=4096).params
        prompts, _, prompt_len, _ = WORKLOADS[args.workload]
        data = tmp_path / "prompts.jsonl"
        write_prompts(data, prompts * max(args.steps, 1), prompt_len)
        spec = workflow(args, str(model), data)
        env = dict(os.environ)
        profile_dir = tmp_path / "profiles"
        if args.profile:
            shutil.copy(HERE / "phase_profiler.py", tmp_path / "phase_profiler.py")
            spec["plugins"] = ["phase_profiler"]
            env["POSTTRAIN_PROFILE_DIR"] = str(profile_dir)
        path = tmp_path / "rl_step.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        run = run_workflow(path, args.set, env=env)
        profiles = sorted(profile_dir.glob("*.txt")) if args.profile else []
        for profile in profiles:
            print(f"\n## profile: {profile.stem}\n```\n{profile.read_text()}```")

    print(
        f"\nRL step: {args.shape} ({params / 1e9:.2f}B), {args.workload} workload, "
        f"{args.layout} layout, {args.trainer}, {device_name(args.device)}; "
        f"{len(steady(run.metrics))} steady steps"
    )
    print_table(
        phase_rows(args, run.metrics, params),
        formats={"s": ".3f", "tokens": ",.0f", "TFLOP/s/GPU": ".1f", "of peak": ".1%"},
    )
    print("\nper step (seconds: the phase / its hooks on the slowest rank)")
    print_table(
        [
            {
                "step": m["step"],
                **{phase: _seconds(m, phase) for phase in PHASES},
                "step s": m["time/step"],
            }
            for m in run.metrics
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
