"""How soon the first rollout comes back on a cold machine (issue 43's "first step soon"), for
``hf_infer``'s decode modes: ``auto`` (on a GPU, ``cuda_graph`` while the compiled step is built
on a background thread, then ``compiled``) against ``compiled`` (the compile first: the first
generation waits for it), each in a process of its own with empty torch compile caches
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` in a new temporary folder, unless
``--warm-cache``), on one model built once.

Each process loads the engine (no launcher: "ready" is the model loaded on the device), then
runs ``--steps`` rollouts back to back (``--batch`` prompts of 16 random tokens,
``--new-tokens`` forced new tokens, temperature 1, ``--top-k``), ``--gap`` seconds apart (the
trainer's share of a step, during which a background compile goes on). Then, where the compiled
step is not serving yet, it waits for the compile and runs ``--after`` more rollouts. Printed:
the time from ready to the first rollout returned (the goal: 30 s), each rollout's seconds and
the mode that served it, the step from which ``compiled`` served and the compile's wall time,
and the rollouts' new tokens/s in each mode (the first rollout of a mode left out: it captures
its graphs).

    python3 benchmarks/first_rollout.py --device cuda --shape qwen2-1.5b \
        --modes auto compiled cuda_graph   # cuda_graph: its speed with no compile beside it
    python3 benchmarks/first_rollout.py --device cuda --shape qwen2.5-7b --modes auto
    python benchmarks/first_rollout.py --device cpu --shape tiny --batch 4 --new-tokens 8 \
        --modes auto --steps 2 --after 1 --backend eager --top-k 8  # its smallest setting

On the CPU, ``auto`` compiles in the background as on a GPU (the static step in place of the
graphed one; the engine's own ``auto`` decodes dynamically there), and ``--backend eager``
stands Dynamo's eager backend in for Inductor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import build_model, device_name, print_table

PROMPT_TOKENS = 16


def make_worker(model_dir: str, device: str, dtype: str, mode: str, batch: int):
    from posttrain.config.sections import ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.plugin import HFInferConfig

    worker = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=HFInferConfig(decode=mode, batch_size=batch),
        model_args=ModelArgs(model_name_or_path=model_dir, dtype=dtype),
        device=device,
    )
    worker.model = hf_infer.load_model(worker)
    return worker


def rollout(worker, prompts, new_tokens: int, seed: int, top_k: int) -> float:
    """Seconds of one generation (the device drained before and after)."""
    import torch

    from posttrain.protocol import GenerationRequest, SamplingParams
    from posttrain_hf_infer import engine as hf_infer

    sampling = SamplingParams(n=1, max_new_tokens=new_tokens, ignore_eos=True, top_k=top_k)
    on_gpu = worker.device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = hf_infer.generate(
        worker, GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=seed)
    )
    if on_gpu:
        torch.cuda.synchronize()
    if any(len(r) != new_tokens for r in out.response_ids):
        raise RuntimeError("a sample ended before its forced length")
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> dict:
    """One mode in this process (its caches set by the parent): the figures, as a dict."""
    import random

    import torch

    from posttrain_hf_infer import engine, static_decode
    from posttrain_hf_infer.engine import HFInferState

    static_decode.STEP_BACKEND = args.backend
    if args.device == "cpu":
        engine.BACKGROUND_COMPILE_DEVICES = ("cpu",)  # see the module docstring
    started = time.perf_counter()
    worker = make_worker(args.model_dir, args.device, args.dtype, args.child, args.batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    ready = time.perf_counter()
    state = worker.engine_state(HFInferState)
    rng = random.Random(0)
    vocab = state.tokenizer.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(args.batch)]

    steps: list[dict] = []

    def step() -> None:
        seconds = rollout(worker, prompts(), args.new_tokens, len(steps), args.top_k)
        steps.append(
            {"s": seconds, "served": state.decode_served, "at": time.perf_counter() - ready}
        )
        print(
            f"{args.child} step {len(steps)}: {seconds:.2f} s ({state.decode_served})", flush=True
        )

    for index in range(args.steps):
        if index:
            time.sleep(args.gap)
        step()
    job = state.compile_job
    waited = None
    if job is not None and not job.ready:
        start = time.perf_counter()
        job.wait()
        waited = time.perf_counter() - start
    if job is not None and job.ready and steps[-1]["served"] != "compiled":
        for _ in range(args.after):
            step()
    return {
        "mode": args.child,
        "load s": ready - started,
        "steps": steps,
        "compile s": None if job is None else job.seconds,
        "compile error": None if job is None or job.error is None else repr(job.error),
        "waited s": waited,
    }


def tokens_per_s(steps: list[dict], served: str, tokens: int) -> float | None:
    """New tokens/s of the rollouts ``served`` in that mode, its first one left out."""
    times = [s["s"] for s in steps if s["served"] == served][1:]
    return tokens / statistics.median(times) if times else None


def run_mode(args: argparse.Namespace, mode: str, model_dir: str) -> dict:
    """``mode`` in a process of its own, with empty compile caches unless ``--warm-cache``."""
    with tempfile.TemporaryDirectory(prefix="first_rollout_cache_") as cache:
        env = dict(os.environ)
        if not args.warm_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
            env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        out = os.path.join(cache, "figures.json")
        command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        command += ["--child", mode, "--model-dir", model_dir, "--out", out]
        subprocess.run(command, env=env, check=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="rollouts back to back")
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between two rollouts")
    parser.add_argument("--after", type=int, default=3, help="rollouts once compiled serves")
    parser.add_argument("--modes", nargs="+", default=["auto", "compiled"])
    parser.add_argument("--warm-cache", action="store_true", help="keep torch's compile caches")
    parser.add_argument("--backend", default="inductor", help="the compiled step's backend")
    parser.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="a top-k filter: the general sampling, not the compiled decode's fused one (on "
        "the CPU that one is compiled by Inductor at the first compiled rollout)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.child:
        Path(args.out).write_text(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory() as model_dir:
        built = build_model(args.shape, model_dir, dtype=args.dtype, device=args.device)
        results = [run_mode(args, mode, model_dir) for mode in args.modes]
    tokens = args.batch * args.new_tokens
    rows = []
    for result in results:
        steps = result["steps"]
        compiled_from = next(
            (i + 1 for i, s in enumerate(steps) if s["served"] == "compiled"), None
        )
        rows.append(
            {
                "mode": result["mode"],
                "load s": result["load s"],
                "ready to first rollout s": steps[0]["at"],
                "served first": steps[0]["served"],
                "compiled from step": compiled_from,
                "compile s": result["compile s"],
                "waited s": result["waited s"],
                "uncompiled tok/s": tokens_per_s(
                    steps, "cuda_graph" if args.device == "cuda" else "static", tokens
                ),
                "compiled tok/s": tokens_per_s(steps, "compiled", tokens),
            }
        )
    title = (
        f"first rollout: {args.shape} ({built.params / 1e9:.2f}B params, {args.dtype}) on "
        f"{device_name(args.device)}; {args.batch} x ({PROMPT_TOKENS} prompt + "
        f"{args.new_tokens} new tokens, forced); compile caches "
        f"{'warm' if args.warm_cache else 'empty'}"
    )
    print_table(rows, title, formats={"uncompiled tok/s": ",.0f", "compiled tok/s": ",.0f"})
    print()
    longest = max(len(r["steps"]) for r in results)
    per_step = []
    for index in range(longest):
        row: dict = {"step": str(index + 1)}
        for result in results:
            steps = result["steps"]
            row[result["mode"]] = (
                f"{steps[index]['s']:.2f} ({steps[index]['served']})"
                if index < len(steps)
                else None
            )
        per_step.append(row)
    print_table(per_step, "each rollout, seconds (the mode that served it)")
    failed = [r["compile error"] for r in results if r["compile error"]]
    if failed:
        print(f"background compile failed: {failed[0]}")


if __name__ == "__main__":
    main()
