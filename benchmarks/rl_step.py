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

    python benchmarks/rl_step.py --device cuda --shape llama3.1-8b --workload long --gpus 4 \
        --trainer megatron_train \
        --set actor_train.strategy_args.strategy_config.tensor_model_parallel_size=2  # 4 GPUs

Workloads: ``short`` (16 prompts x 8, 16-token prompts, 64 new tokens), ``long`` (32 prompts x
8, 256-token prompts, 1024 new tokens), ``realistic`` (as long, lengths long-tailed: mean ~1K,
at most 4K; see REALISTIC_MEAN) and ``tiny`` (2 prompts x 2, 8 + 4 tokens). Layouts over
``--gpus`` GPUs: ``hybrid`` (every role on every GPU, one process a GPU; 1 GPU by default),
``disaggregated`` (trainer and reference on the first GPUs, rollout on the last
``--rollout-gpus``; 2 GPUs by default), ``colocated`` (hybrid on 2 GPUs by default).
``--profile`` writes the top 15 operations of each phase's second call
(benchmarks/phase_profiler.py) and prints them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import (
    SHAPES,
    build_model,
    device_name,
    flops_per_token,
    model_config,
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
    "realistic": (32, 8, 256, 4096),
    "tiny": (2, 2, 8, 4),
}
# ``realistic``: responses end at any of REALISTIC_STOPS-th of the vocabulary's tokens. A random
# model samples nearly uniformly, so a response's length is geometric with mean ~1,000 tokens,
# capped at 4,096 (e^-4, about 2% of them): NeMo-RL's long-tailed shape of work (4K max, ~1K
# mean), where the longest rows hold the step.
REALISTIC_MEAN = 1000
LAYOUTS = ("hybrid", "disaggregated", "colocated")
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


def devices(args) -> tuple[list[int], list[int]]:
    """(trainer and reference GPUs, rollout GPUs) of ``args.layout`` over ``args.gpus`` GPUs:
    hybrid and colocated share them all (colocated is hybrid's old name for 2 GPUs);
    disaggregated gives the last ``args.rollout_gpus`` to the rollout."""
    gpus = args.gpus or (2 if args.layout in ("colocated", "disaggregated") else 1)
    every = list(range(gpus))
    if args.layout != "disaggregated":
        return every, every
    split = gpus - args.rollout_gpus
    return every[:split], every[split:]


def stops(args) -> list[int]:
    """The ``realistic`` workload's stop tokens: one in REALISTIC_MEAN of the vocabulary's ids
    past the tokenizer's own (none for the other workloads: their lengths are forced)."""
    if args.workload != "realistic":
        return []
    vocab = SHAPES[args.shape]["vocab_size"]
    count = max(1, vocab // REALISTIC_MEAN)
    return list(range(vocab - count, vocab))


def workflow(args, model: str, data: Path) -> dict:
    prompts, group, prompt_len, new_tokens = WORKLOADS[args.workload]
    train_devices, infer_devices = devices(args)
    cuda = args.device == "cuda"
    # Micro-batches by tokens (dynamic batching) unless --micro-batch fixes their rows; the
    # reference scores as many whole rows as the budget holds.
    mean_new = min(new_tokens, REALISTIC_MEAN) if args.workload == "realistic" else new_tokens
    rows = max(1, args.max_tokens // (prompt_len + mean_new))
    batching = (
        {"per_device_train_batch_size": args.micro_batch}
        if args.micro_batch
        else {"use_dynamic_batch_size": True, "max_tokens_per_micro_batch": args.max_tokens}
    )
    # Chunked log-probs (every trainer and reference strategy) unless the flag says otherwise.
    chunking = (
        {}
        if args.logprob_chunk_tokens is None
        else {"logprob_chunk_tokens": args.logprob_chunk_tokens}
    )
    return {
        "model_args": {
            "model_name_or_path": model,
            "dtype": "bf16" if cuda else "fp32",
            # auto: the memory plan turns it on where a GPU would otherwise fill.
            "disable_gradient_checkpointing": {"auto": "auto", "on": False, "off": True}[
                args.checkpointing
            ],
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
            "generating_args": {
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
                "stop_token_ids": stops(args),
            },
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


def planned_peaks(path: Path, overrides: list[str]) -> dict[str, float]:
    """The memory plan's peak GiB of each phase (the largest over GPUs), for the workflow at
    ``path`` as ``posttrain run`` plans it (``auto`` checkpointing and release knobs resolved for
    this GPU, or ``cluster.gpu_memory_gib``)."""
    from posttrain.cli import _parse_overrides
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.loading.workflow import load_workflow
    from posttrain.memory.plan import card_bytes, plan_memory, resolve_memory

    host = create_plugin_host()
    workflow, report = load_workflow(str(path), host, _parse_overrides(overrides))
    report.raise_if_errors(str(path))
    workflow = resolve_memory(workflow, host, card_bytes(workflow))
    peaks: dict[str, float] = {}
    for peak in plan_memory(workflow, host).peaks:
        peaks[peak.phase] = max(peaks.get(peak.phase, 0.0), peak.total / 2**30)
    return peaks


def phase_rows(args, metrics: list[dict], params: int, planned: dict[str, float]) -> list[dict]:
    prompts, group, prompt_len, _ = WORKLOADS[args.workload]
    train_devices, infer_devices = devices(args)
    gpus = len(set(train_devices) | set(infer_devices))
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
    trainer_gpus = len(train_devices)
    rows = []
    for phase in PHASES:
        seconds = mean(f"time/{phase}")
        count, flops = work[phase]
        busy = trainer_gpus if args.layout == "disaggregated" else gpus
        tflops = flops / seconds / busy / 1e12 if seconds else 0.0
        row = {
            "phase": phase,
            "s": seconds,
            "tokens": count,
            "TFLOP/s/GPU": tflops,
            "of peak": tflops / peak if peak else None,
            "peak GiB": mean(f"memory/{phase}_peak_gib") or None,
            "plan GiB": planned.get(phase),
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
            "plan GiB": None,
            "on ranks s": None,
            "other": f"{3600 / step:,.0f} steps/h, {tokens / step / gpus:,.0f} tokens/s/GPU",
        }
    )
    return rows


def _seconds(metrics: dict, phase: str) -> str:
    return f"{metrics.get(f'time/{phase}', 0):.2f} / {metrics.get(f'rank_time/{phase}_s', 0):.2f}"


def built_params(args, model: str, dtype: str) -> int:
    """Build the model (on the GPU in a process of its own, whose CUDA context is gone before the
    ranks start) and return its parameter count. Its positions cover the workload's longest
    row (``realistic``: 256 + 4,096 tokens)."""
    _, _, prompt_len, new_tokens = WORKLOADS[args.workload]
    positions = max(4096, prompt_len + new_tokens)
    if args.device != "cuda":
        return build_model(args.shape, model, dtype=dtype, max_positions=positions).params
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        job = pool.submit(
            build_model, args.shape, model, dtype=dtype, max_positions=positions, device="cuda"
        )
        return job.result().params


def print_plan(args, model: Path, tmp_path: Path) -> int:
    """``posttrain plan`` of the benchmark's workflow, from the shape's config alone."""
    config, _ = model_config(args.shape)
    config.save_pretrained(model)
    data = tmp_path / "prompts.jsonl"
    write_prompts(data, WORKLOADS[args.workload][0], WORKLOADS[args.workload][2])
    path = tmp_path / "rl_step.yaml"
    path.write_text(yaml.safe_dump(workflow(args, str(model), data), sort_keys=False))
    command = [sys.executable, "-m", "posttrain.cli", "plan", str(path)]
    command += ["--gpu-memory-gib", str(args.plan_only)]
    for item in args.set:
        command += ["--set", item]
    return subprocess.run(command, check=False).returncode


def add_workload_arguments(parser: argparse.ArgumentParser, shape: str) -> None:
    """The arguments of the scripts that run this workload over a whole run (memory_flat.py,
    rank_kill.py): where, which shape, which workload, trainer and decode mode."""
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default=shape, choices=sorted(SHAPES))
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="the workload (default: tiny for the tiny shape, else short)",
    )
    parser.add_argument("--trainer", default="fsdp2_train", choices=sorted(INFER_OF))
    parser.add_argument(
        "--decode",
        default="auto",
        choices=("auto", "dynamic", "static", "cuda_graph", "compiled"),
        help="hf_infer's decode mode (cuda_graph: no 2-minute compile at a run's start)",
    )
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")


def default_workload(args: argparse.Namespace) -> str:
    return args.workload or ("tiny" if args.shape == "tiny" else "short")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    parser.add_argument("--layout", default="hybrid", choices=LAYOUTS)
    parser.add_argument(
        "--gpus", type=int, help="GPUs of the layout (default: 1 hybrid, 2 otherwise)"
    )
    parser.add_argument(
        "--rollout-gpus", type=int, default=1, help="disaggregated: the rollout's share of --gpus"
    )
    parser.add_argument("--trainer", default="fsdp2_train", choices=sorted(INFER_OF))
    parser.add_argument("--reference", help="the reference's strategy (default: the trainer's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--max-tokens", type=int, default=16384, help="tokens per micro-batch (dynamic batching)"
    )
    parser.add_argument("--micro-batch", type=int, help="rows per micro-batch instead of tokens")
    parser.add_argument(
        "--checkpointing",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation checkpointing (auto: the workflow's default, from the memory plan)",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler of each phase")
    parser.add_argument(
        "--logprob-chunk-tokens",
        type=int,
        help="strategy_config.logprob_chunk_tokens of the trainer and the reference (0: "
        "full-vocabulary logits); default: the strategies' own",
    )
    parser.add_argument("--set", action="append", default=[], help="extra workflow overrides")
    parser.add_argument(
        "--plan-only",
        type=float,
        metavar="GIB",
        help="build nothing, run nothing: print `posttrain plan` of the workflow for GPUs of GIB "
        "(79.6 for an H100 80GB), from the shape's config alone",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = tmp_path / args.shape
        dtype = "bf16" if args.device == "cuda" else "fp32"
        if args.plan_only:
            return print_plan(args, model, tmp_path)
        params = built_params(args, str(model), dtype)
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
        planned = planned_peaks(path, args.set)
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
        phase_rows(args, run.metrics, params, planned),
        formats={
            "s": ".3f",
            "tokens": ",.0f",
            "TFLOP/s/GPU": ".1f",
            "of peak": ".1%",
            "peak GiB": ".1f",
            "plan GiB": ".1f",
        },
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
