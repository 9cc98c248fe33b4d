"""SGLang rollout through the posttrain plugin against plain SGLang, and weight-sync time per path.

One engine per model, driven by the plugin in this process (``WorkerRuntime``). On it, the same
prompts and sampling settings go once through the plugin's ``posttrain_generate`` hook and once
straight to ``Engine.generate``: the tokens/s ratio is the plugin's overhead. Weight sync of a
full state dict, both import paths of the plugin:

* ``tensor``: ``posttrain_import_weights`` per bucket (``update_weights_from_tensor``), what the
  ``shared_memory`` transport does for colocated roles;
* ``distributed``: a sender process plays trainer rank 0 of the ``broadcast`` transport (the
  core's own rank-side functions), SGLang's scheduler joins the group and receives every bucket
  (``update_weights_from_distributed``, gloo on CPU).

Models: ``preset:tiny-qwen2`` and a ~100M-parameter Qwen2-shaped model built here with random
weights (``qwen2-100m`` of benchmarks/common.py). Run it in the SGLang venv (``.ci/sglang_env.sh``):

    .venv-sglang/bin/python benchmarks/sglang_rollout.py [--prompts 64] [--n 4]
        [--max-new-tokens 32] [--max-total-tokens 16384] [--skip-100m]
    .venv-sglang/bin/python benchmarks/sglang_rollout.py --prompts 2 --n 1 --max-new-tokens 2 \
        --repeats 1 --skip-100m                                           # smoke check
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
from types import SimpleNamespace

from common import build_model, print_table

RANK_SIDE = "posttrain.weight_sync.rank_side"


def make_worker(model_path: str, base_dir: str, infer_batch_size: int, kv_tokens: int):
    from posttrain import ModelArgs, WorkerContext, WorkerRuntime
    from posttrain.config.converter import CONVERTER
    from posttrain.host.plugin_host import create_plugin_host

    host = create_plugin_host()
    # A KV cache that holds the whole batch: with less, SGLang retracts and recomputes requests,
    # and the rates measure that instead.
    raw = {"max_total_tokens": kv_tokens}
    config = CONVERTER.structure(raw, host.strategies()["sglang"].config_class)
    ctx = WorkerContext(
        role="actor_infer",
        strategy_name="sglang",
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
    from posttrain import GenerationRequest, SamplingParams
    from posttrain_sglang import engine
    from posttrain_sglang.state import SGLangState

    prompts = [[1, 4 + i % 10, 14, 4 + (i * 7) % 10, 17] for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
    request = GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=11)
    sglang_engine = runtime.ctx.engine_state(SGLangState).engine
    # The plugin's translation of the settings, without its per-sample seeds.
    params = engine.sampling_params(runtime.ctx, sampling)

    def plugin() -> int:
        out = runtime.generate(request)
        return sum(len(r) for r in out.response_ids)

    def plain() -> int:
        # The same requests straight to SGLang: each prompt n times, the same settings.
        input_ids = [p for p in prompts for _ in range(args.n)]
        outs = sglang_engine.generate(
            input_ids=input_ids, sampling_params=params, return_logprob=True
        )
        return sum(len(o["output_ids"]) for o in outs)

    plugin()  # warm-up
    plain()
    rates: dict[str, list[float]] = {"plugin": [], "plain": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        for name, fn in (("plugin", plugin), ("plain", plain)):
            # Each run starts from an empty KV cache: the previous run's sequences would
            # otherwise have to be evicted during this one.
            sglang_engine.flush_cache()
            started = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - started))
    print("tok/s per run:", {k: [round(r) for r in v] for k, v in rates.items()}, flush=True)
    return max(rates["plugin"]), max(rates["plain"])


def _buckets(model_path: str, bucket_bytes: int):
    from safetensors.torch import load_file

    from posttrain import bucketize

    state = load_file(os.path.join(model_path, "model.safetensors"))
    return list(bucketize(sorted(state.items()), bucket_bytes))


def tensor_sync_time(runtime, model_path: str, bucket_bytes: int) -> tuple[float, int, int]:
    buckets = _buckets(model_path, bucket_bytes)
    runtime.import_weights(buckets[:1])  # warm-up
    started = time.perf_counter()
    for bucket in buckets:
        runtime.import_weights([bucket])
    return time.perf_counter() - started, len(buckets), sum(b.nbytes for b in buckets)


def _sender(conn, port: int, group: str, model_path: str, bucket_bytes: int) -> None:
    """Trainer rank 0 of the broadcast transport, with the core's rank-side functions."""
    import importlib

    from posttrain.weight_sync.verify import SyncState

    rank_side = importlib.import_module(RANK_SIDE)
    buckets = iter(_buckets(model_path, bucket_bytes))
    runtime = SimpleNamespace(
        ctx=SimpleNamespace(device="cpu", state={}, sync=SyncState(), hook=None),
        export_next=lambda: next(buckets, None),
    )
    rank_side.join_sync_group(runtime, "127.0.0.1", port, 0, 2, 300.0, group)
    while True:
        meta = rank_side.export_next_meta(runtime)
        conn.send(meta)
        if meta is None:
            break
        conn.recv()  # the receiver is about to take part in the broadcast
        rank_side.broadcast_pending(runtime)
    conn.recv()
    rank_side.leave_sync_group(runtime)


def distributed_sync_time(runtime, model_path: str, bucket_bytes: int) -> tuple[float, int]:
    import importlib

    from posttrain.weight_sync.rank_side import free_port

    rank_side = importlib.import_module(RANK_SIDE)
    port = free_port(runtime)
    group = f"posttrain_weight_sync_{port}"
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, port, group, model_path, bucket_bytes))
    proc.start()
    try:
        rank_side.join_sync_group(runtime, "127.0.0.1", port, 1, 2, 300.0, group)
        count, elapsed = 0, 0.0
        while True:
            meta = parent.recv()
            if meta is None:
                break
            started = time.perf_counter()
            parent.send("go")
            rank_side.receive_and_import(runtime, meta)
            elapsed += time.perf_counter() - started
            count += 1
        rank_side.leave_sync_group(runtime)
        parent.send("done")
    finally:
        # SGLang's shutdown kills every child of this process: the sender must be gone first.
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return elapsed, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--skip-100m", action="store_true")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="sglang-bench-")
    os.environ.setdefault("POSTTRAIN_CACHE", os.path.join(tmp, "cache"))
    from posttrain.tasks.presets import preset_path

    tiny = preset_path("preset:tiny-qwen2")
    models = [("tiny-qwen2 (preset)", tiny)]
    if not args.skip_100m:
        big = os.path.join(tmp, "qwen2-100m")
        params = build_model("qwen2-100m", big, max_positions=512).params
        models.append((f"qwen2 {params / 1e6:.0f}M (random)", big))

    rows = []
    try:
        for label, path in models:
            started = time.perf_counter()
            runtime = make_worker(path, tmp, args.prompts, args.max_total_tokens)
            start_s = time.perf_counter() - started
            try:
                plugin_rate, plain_rate = rollout_rates(runtime, args)
                bucket_bytes = args.bucket_mb << 20
                tensor_s, buckets, nbytes = tensor_sync_time(runtime, path, bucket_bytes)
                dist_s, dist_buckets = distributed_sync_time(runtime, path, bucket_bytes)
                if dist_buckets != buckets:
                    raise RuntimeError(f"sent {dist_buckets} buckets, expected {buckets}")
            finally:
                runtime.shutdown()
            rows.append(
                {
                    "model": label,
                    "start s": f"{start_s:.1f}",
                    "plugin tok/s": f"{plugin_rate:.0f}",
                    "plain SGLang tok/s": f"{plain_rate:.0f}",
                    "plugin/plain": f"{plugin_rate / plain_rate:.3f}",
                    "sync s (tensor)": f"{tensor_s:.3f}",
                    "sync s (distributed)": f"{dist_s:.3f}",
                    "buckets": buckets,
                    "MB synced": f"{nbytes / 1e6:.0f}",
                }
            )
            print(f"done: {label}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print_table(
        rows,
        f"\nrollout: {args.prompts} prompts x n={args.n}, up to {args.max_new_tokens} new tokens, "
        f"temperature 1, fp32, torch_native attention, KV cache {args.max_total_tokens} tokens, "
        f"CPU threads={os.cpu_count()}; sync buckets of {args.bucket_mb} MiB",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
