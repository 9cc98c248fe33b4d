"""Continuous batching in ``hf_infer``: generation throughput when samples end at different
lengths, with more prompts than rows in flight. In one run, against the first mode given:

- ``dynamic``: transformers' growing cache (the path before the fast one), rows in batches;
- ``batched``: the fixed-shape decode (``--decode``: ``compiled`` on cuda, ``static`` on cpu)
  with ``continuous_batching: false``, where a batch of rows runs until its longest sample ends;
- ``continuous``: the same decode, each row refilled with the next prompt once its sample ends;
  with ``--refill-shares``, once per share of free rows that triggers a refill
  (``decode_loop.REFILL_SHARE``, set for the row: a tuning run).

Every mode: ``--prompts`` prompts of 16 to ``--max-prompt`` random tokens, ``--rows`` in flight,
temperature 1, up to ``--new-tokens`` new tokens. Samples end on stop tokens, a random
``vocab / --mean-length`` of the vocabulary. The model's final norm is zeroed, so every logit is
0: the next token is uniform (the compute is unchanged), and the lengths are geometric with that
mean, capped at ``--new-tokens`` (the long tail of RL responses). The first call warms up
(captures graphs, compiles); the second is timed. Tokens/s counts the generated tokens.

    python3 benchmarks/continuous_batching.py --device cuda --shape qwen2-1.5b
    python3 benchmarks/continuous_batching.py --device cuda --shape qwen2-1.5b \
        --modes batched continuous --refill-shares 2 4 8 16 32
    python benchmarks/continuous_batching.py --shape tiny --device cpu --prompts 12 --rows 4 \\
        --new-tokens 16 --mean-length 6                                   # its smallest setting
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from common import build_model, device_name, print_table
from generation import make_worker

MODES = ("dynamic", "batched", "continuous")


def workload(vocab: int, args) -> tuple[list[list[int]], tuple[int, ...]]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(16, args.max_prompt))]
        for _ in range(args.prompts)
    ]
    stops = tuple(rng.sample(range(3, vocab), max(1, vocab // args.mean_length)))
    return prompts, stops


def timed(worker, prompts, sampling) -> tuple[float, list[list[int]]]:
    import torch

    from posttrain.protocol import GenerationRequest
    from posttrain_hf_infer import engine as hf_infer

    on_gpu = worker.device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    request = GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=1)
    responses = hf_infer.generate(worker, request).response_ids
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start, responses


def measure(worker, mode: str, decode: str, prompts, stops, args, share: int | None) -> dict:
    import attrs

    from posttrain.protocol import SamplingParams
    from posttrain_hf_infer import decode_loop
    from posttrain_hf_infer.engine import HFInferState

    worker.config = attrs.evolve(
        worker.config,
        decode="dynamic" if mode == "dynamic" else decode,
        continuous_batching=mode == "continuous",
        batch_size=args.rows,
    )
    worker.engine_state(HFInferState).decoders = None
    sampling = SamplingParams(
        n=1, max_new_tokens=args.new_tokens, ignore_eos=True, stop_token_ids=stops
    )
    default_share = decode_loop.REFILL_SHARE
    decode_loop.REFILL_SHARE = share or default_share
    try:
        first, _ = timed(worker, prompts, sampling)
        seconds, responses = timed(worker, prompts, sampling)
    finally:
        decode_loop.REFILL_SHARE = default_share
    lengths = [len(r) for r in responses]
    worker.engine_state(HFInferState).decoders = None
    return {
        "mode": mode if share is None else f"{mode}, refill at 1/{share} free",
        "first call s": first,
        "s": seconds,
        "new tokens": sum(lengths),
        "mean length": statistics.mean(lengths),
        "longest": max(lengths),
        "tok/s": sum(lengths) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--decode", default=None, choices=["static", "cuda_graph", "compiled"])
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--mean-length", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--refill-shares",
        type=int,
        nargs="+",
        default=None,
        help="continuous once per share (default: the engine's REFILL_SHARE)",
    )
    args = parser.parse_args()
    if any(share < 1 for share in args.refill_shares or ()):
        parser.error(f"--refill-shares: each at least 1, got {args.refill_shares}")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    decode = args.decode or ("compiled" if args.device == "cuda" else "static")
    with tempfile.TemporaryDirectory() as model_dir:
        built = build_model(args.shape, model_dir, dtype=dtype)
        worker = make_worker(model_dir, args.device, dtype)
        worker.model.model.norm.weight.data.zero_()  # every logit 0: see the docstring
        prompts, stops = workload(worker.model.config.vocab_size, args)
        rows, baseline = [], None
        for mode in args.modes:
            shares = args.refill_shares if mode == "continuous" and args.refill_shares else [None]
            for share in shares:
                row = measure(worker, mode, decode, prompts, stops, args, share)
                baseline = baseline or row["tok/s"]
                row[f"vs {args.modes[0]}"] = row["tok/s"] / baseline
                rows.append(row)
                print(f"{row['mode']}: {row['tok/s']:,.0f} tok/s", flush=True)
    print_table(
        rows,
        f"hf_infer, samples of different lengths: {args.shape} ({built.params / 1e9:.2f}B, "
        f"{dtype}) on {device_name(args.device)}; {args.prompts} prompts of 16-{args.max_prompt} "
        f"tokens, {args.rows} rows, up to {args.new_tokens} new tokens (stop tokens for a mean "
        f"of ~{args.mean_length}); {decode} decode",
        formats={"tok/s": ",.0f", "mean length": ".1f", f"vs {args.modes[0]}": ".2f"},
        text_columns=1,
    )


if __name__ == "__main__":
    main()
