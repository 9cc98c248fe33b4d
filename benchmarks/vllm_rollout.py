"""vLLM rollout through the posttrain plugin against plain vLLM, and weight-sync time.

One engine per model and engine mode; on it, the same prompts and sampling settings go once
through the plugin's ``posttrain_generate`` hook and once straight to ``LLM.generate``: the
tokens/s ratio is the plugin's overhead. Weight sync times ``posttrain_import_weights`` for every
bucket of a full state dict (in-process: tensors through ``collective_rpc``; multiprocessing
engine: safetensors in /dev/shm). Models: ``preset:small-qwen2`` (~3M parameters) and a
~100M-parameter Qwen2-shaped model built here with random weights (``qwen2-100m`` of
benchmarks/common.py).

    .venv-vllm/bin/python benchmarks/vllm_rollout.py [--prompts 64] [--n 4] [--max-new-tokens 32]
        [--skip-100m] [--skip-mp]
    .venv-vllm/bin/python benchmarks/vllm_rollout.py --prompts 2 --n 1 --max-new-tokens 2 \
        --repeats 1 --skip-100m --skip-mp                                # smoke check
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from common import build_model, print_table


def make_worker(model_path: str, base_dir: str, infer_batch_size: int):
    from posttrain import ModelArgs, WorkerContext, WorkerRuntime
    from posttrain.config.converter import CONVERTER
    from posttrain.host.plugin_host import create_plugin_host

    host = create_plugin_host()
    config = CONVERTER.structure({}, host.strategies()["vllm"].config_class)
    ctx = WorkerContext(
        role="actor_infer",
        strategy_name="vllm",
        config=config,
        model_args=ModelArgs(model_name_or_path=model_path),
        base_dir=base_dir,
        run_dir=base_dir,
        hook=host.hook,
        seed=0,
        infer_batch_size=infer_batch_size,
    )
    runtime = WorkerRuntime(ctx)
    runtime.setup()
    return runtime


def rollout_rates(runtime, args) -> tuple[float, float]:
    from vllm.inputs import TokensPrompt

    from posttrain import GenerationRequest, SamplingParams
    from posttrain_vllm import engine
    from posttrain_vllm.engine import VLLMState

    prompts = [[1, 4 + i % 10, 14, 4 + (i * 7) % 10, 17] for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    request = GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=11)
    llm = runtime.ctx.engine_state(VLLMState).engine

    def plugin() -> int:
        out = runtime.generate(request)
        return sum(len(r) for r in out.response_ids)

    def plain() -> int:
        params = [
            engine.sampling_params(runtime.ctx, sampling, engine._request_seed(11, i, args.n))
            for i in range(len(prompts))
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    plugin()  # warm-up
    plain()
    rates: dict[str, list[float]] = {"plugin": [], "plain": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        for name, fn in (("plugin", plugin), ("plain", plain)):
            started = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - started))
    return max(rates["plugin"]), max(rates["plain"])


def sync_time(runtime, model_path: str, bucket_bytes: int) -> tuple[float, int, int]:
    from safetensors.torch import load_file

    from posttrain import bucketize

    state = load_file(os.path.join(model_path, "model.safetensors"))
    buckets = list(bucketize(sorted(state.items()), bucket_bytes))
    nbytes = sum(b.nbytes for b in buckets)
    runtime.import_weights(buckets[:1])  # warm-up
    started = time.perf_counter()
    for bucket in buckets:
        runtime.import_weights([bucket])
    return time.perf_counter() - started, len(buckets), nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--skip-100m", action="store_true")
    parser.add_argument("--skip-mp", action="store_true")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="vllm-bench-")
    os.environ.setdefault("POSTTRAIN_CACHE", os.path.join(tmp, "cache"))
    from posttrain.tasks.presets import preset_path

    small = preset_path("preset:small-qwen2")
    models = [("small-qwen2 (preset)", small)]
    if not args.skip_100m:
        big = os.path.join(tmp, "qwen2-100m")
        params = build_model("qwen2-100m", big, max_positions=512).params
        models.append((f"qwen2 {params / 1e6:.0f}M (random)", big))
    modes = ["0"] if args.skip_mp else ["0", "1"]

    rows = []
    try:
        for mode in modes:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mode
            for label, path in models:
                started = time.perf_counter()
                runtime = make_worker(path, tmp, args.prompts)
                start_s = time.perf_counter() - started
                plugin_rate, plain_rate = rollout_rates(runtime, args)
                sync_s, buckets, nbytes = sync_time(runtime, path, args.bucket_mb << 20)
                runtime.shutdown()
                engine_mode = "multiprocess" if mode == "1" else "in-process"
                rows.append(
                    {
                        "model": label,
                        "engine": engine_mode,
                        "start s": f"{start_s:.1f}",
                        "plugin tok/s": f"{plugin_rate:.0f}",
                        "plain vLLM tok/s": f"{plain_rate:.0f}",
                        "plugin/plain": f"{plugin_rate / plain_rate:.3f}",
                        "sync s": f"{sync_s:.3f}",
                        "buckets": buckets,
                        "MB synced": f"{nbytes / 1e6:.0f}",
                    }
                )
                print(f"done: {label} {engine_mode}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print_table(
        rows,
        f"\nrollout: {args.prompts} prompts x n={args.n}, up to {args.max_new_tokens} new tokens, "
        f"temperature 1, fp32, CPU threads={os.cpu_count()}; sync buckets of {args.bucket_mb} MiB",
        text_columns=2,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
