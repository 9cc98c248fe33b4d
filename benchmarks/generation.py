"""Rollout generation speed of ``hf_infer`` in each decode mode (``strategy_config.decode``): the
dynamic cache (transformers' ``generate`` way, the default before the fast path), the static
cache, the static cache with its step in a CUDA graph, and that step compiled (``compiled``:
its first call includes the compile), in one run, against the first mode given.
Two rows are not engine modes but baselines:

- ``before``: hf_infer's decode loop as it was when the fast path was asked for (issue 25's
  "today's path"), kept verbatim: transformers' growing cache, the sampled tokens and log-probs
  copied to the host every step and the rows' ended flags copied back. The ``dynamic`` mode is
  that cache in today's loop, which looks at the host only every few steps.
- ``hf_generate``: transformers' own ``model.generate`` (sampling, dynamic cache, forced
  length), what TRL's GRPOTrainer runs without vLLM. It returns tokens only (log-probs of every
  step's logits would hold ``steps x batch x vocab`` floats: 80 GB at 256 x 512 for this
  vocabulary), so it does less than the engine does.

The engine runs in this process on one device (no launcher: what is timed is the engine). Every
row: ``batch`` prompts of 16 random tokens, ``--new-tokens`` new tokens each (forced:
``ignore_eos``), temperature 1. Per mode and batch: the first call (which captures the graph of
the shape, or warms the kernels up) and then a timed call; time to first token (the prefill and
the first sample: a call with one new token, the second of its shape), decode tokens/s over the
rest, the GB/s of weights read by the decode steps (each step reads every weight once: the
decode's memory-bound floor), the decode's TFLOP/s (2 x params a token, plus attention over the
context) and its fraction of the GPU's dense bf16 peak, the peak device memory of the timed
call, and the largest gap between the log-probs the timed call returned and a transformers
forward pass's over the same tokens (its first rows; a bf16 logit is about 2^-8 of its size
off).

    python3 benchmarks/generation.py --device cuda --shape qwen2-1.5b   # 64, 256, 512 x 512
    python3 benchmarks/generation.py --device cuda --shape qwen2-1.5b --batches 256 \
        --modes before dynamic compiled --attentions auto cudnn  # the decode attention's kernels
    python benchmarks/generation.py --shape tiny --device cpu --batches 4 --new-tokens 8
                                                                         # its smallest setting

A mixture-of-experts shape (``qwen3-30b-a3b-l12``, ``tiny-moe``) runs the same modes: the
fixed-shape ones with the experts' grouped GEMMs of :mod:`posttrain_hf_infer.moe_decode`. Its
TFLOP/s count the active parameters (a token's experts); its weights GB/s all of them (at 64
rows of top-8 of 128, a step hits about 98% of a layer's experts). ``--routing`` asks every
generation for its routing (what ``algorithm.routing_replay: rollout`` asks of the rollout).
``--adapter-rank 16`` times every engine mode again with synced LoRA adapters of rank 16 on
every attention and MLP linear (``lora.sync: adapter``: the base plus the adapters' two small
GEMMs per projection group), each row against the plain engine's (``vs plain``):

    python3 benchmarks/generation.py --device cuda --shape qwen2-1.5b --batches 256 \
        --modes dynamic cuda_graph compiled --adapter-rank 16

The mixture-of-experts shapes' routing, as asked above:

    python3 benchmarks/generation.py --device cuda --shape qwen3-30b-a3b-l12 --batches 64 256 \
        --modes dynamic compiled --routing
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from common import (
    active_params,
    build_model,
    device_name,
    flops_per_token,
    peak_bf16_tflops,
    print_table,
)

PROMPT_TOKENS = 16
# Rows whose log-probs are checked against a forward pass.
CHECKED_ROWS = 4
# The rows that are not hf_infer's modes (see above).
BASELINES = ("before", "hf_generate")


def make_worker(model_dir: str, device: str, dtype: str, adapter_rank: int = 0):
    """The engine on ``device``; with ``adapter_rank``, with synced LoRA adapters of that rank on
    every attention and MLP linear (``lora.sync: adapter``), set to random values as a sync
    would (non-zero: the adapters' GEMMs run whatever their values, but a zero B would hide a
    wrong product in the log-prob gap)."""
    import torch

    from posttrain import WeightBucket
    from posttrain.config.sections import LoraArgs, ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.plugin import HFInferConfig

    lora = LoraArgs(rank=adapter_rank, sync="adapter") if adapter_rank else None
    worker = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=HFInferConfig(),
        model_args=ModelArgs(model_name_or_path=model_dir, dtype=dtype, lora=lora),
        device=device,
    )
    worker.model = hf_infer.load_model(worker)
    if lora is not None:
        shapes = hf_infer.weight_shapes(worker)
        generator = torch.Generator().manual_seed(1)
        adapters = [
            (name, torch.randn(shape, generator=generator) * 0.02)
            for name, shape in shapes.items()
            if ".lora_A." in name or ".lora_B." in name
        ]
        hf_infer.import_weights(worker, [WeightBucket(tensors=adapters)])
    return worker


def hf_infer_state(worker):
    """The engine's state on ``worker``: its tokenizer, its kept decoders."""
    from posttrain_hf_infer.engine import HFInferState

    return worker.engine_state(HFInferState)


def hf_generate(worker, prompts, new_tokens: int) -> list[list[int]]:
    """``model.generate`` of the left-padded prompts, sampled at temperature 1, forced to
    ``new_tokens`` new tokens: the new tokens of each row."""
    import torch

    pad_id = hf_infer_state(worker).tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = worker.model.generate(
        input_ids=ids.to(worker.device),
        attention_mask=mask.to(worker.device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
    )
    return out[:, width:].tolist()


def hf_infer_before(worker, prompts, new_tokens: int, seed: int):
    """hf_infer's ``_sample`` when the fast path was asked for (``git show
    a2b1f01^:plugins/hf_infer/posttrain_hf_infer/engine.py``), as it was, its sampling fixed to this
    benchmark's (temperature 1, no top-k/top-p, forced length, no stop token or string): the
    responses and their log-probs."""
    import torch

    from posttrain_hf_infer.token_sampling import filter_logits

    model, device = worker.model, worker.device
    pad_id = hf_infer_state(worker).tokenizer.pad_token_id
    stop_ids: set[int] = set()
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    width = max(len(p) for p in prompts)
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((batch, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, device=device)
        attention[i, width - len(p) :] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    responses: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    done = [False] * batch
    past = None
    step_ids, step_pos = input_ids, position_ids
    for _ in range(new_tokens):
        outputs = model(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=step_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = outputs.past_key_values
        logits = outputs.logits[:, -1].float()
        raw_logp = torch.log_softmax(logits, dim=-1)
        filtered = filter_logits(logits, 1.0, 0, 1.0)
        probs = torch.softmax(filtered, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token_logp = raw_logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        tokens, token_logps = token.tolist(), token_logp.tolist()
        running = [i for i in range(batch) if not done[i]]
        for i in running:
            responses[i].append(tokens[i])
            logprobs[i].append(token_logps[i])
            if tokens[i] in stop_ids:
                done[i] = True
        if all(done):
            break
        finished = torch.tensor(done, dtype=torch.bool, device=device)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        step_ids = token.unsqueeze(-1)
        step_pos = step_pos[:, -1:] + 1
        attention = torch.cat([attention, (~finished).long().unsqueeze(-1)], dim=-1)
    return responses, logprobs


def timed_generate(worker, prompts, new_tokens: int, mode: str, routing: bool = False):
    """Seconds of one generation, and its responses and their log-probs (``None`` where the
    mode returns none); ``routing``: the engine's generations return their routing."""
    import torch

    from posttrain.protocol import GenerationRequest, SamplingParams
    from posttrain_hf_infer import engine as hf_infer

    sampling = SamplingParams(n=1, max_new_tokens=new_tokens, ignore_eos=True)
    on_gpu = worker.device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    logprobs = None
    if mode == "hf_generate":
        responses = hf_generate(worker, prompts, new_tokens)
    elif mode == "before":
        with torch.no_grad():  # as hf_infer's generate was
            responses, logprobs = hf_infer_before(worker, prompts, new_tokens, seed=1)
    else:
        request = GenerationRequest(
            prompt_ids=prompts, sampling=sampling, seed=1, return_routing=routing
        )
        out = hf_infer.generate(worker, request)
        if routing and out.routing is None:
            raise RuntimeError("the generation returned no routing")
        responses, logprobs = out.response_ids, out.response_logprobs
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if any(len(r) != new_tokens for r in responses):
        raise RuntimeError("a sample ended before its forced length")
    return seconds, responses, logprobs


def worst_logprob_gap(worker, prompts, responses, logprobs) -> float | None:
    """The largest gap between the log-probs returned for the first rows and a transformers
    forward pass's over their prompts and responses."""
    import torch

    from posttrain.scoring.modeling import shifted_token_logprobs

    if logprobs is None:
        return None
    worst = 0.0
    with torch.no_grad():
        for prompt, response, logps in list(zip(prompts, responses, logprobs))[:CHECKED_ROWS]:
            ids = torch.tensor([prompt + response], device=worker.device)
            scored = shifted_token_logprobs(worker.model(input_ids=ids).logits, ids)[0]
            gap = (scored[len(prompt) :].cpu() - torch.tensor(logps)).abs().max()
            worst = max(worst, gap.item())
    return worst


def measure(
    worker,
    mode: str,
    attention: str,
    batch: int,
    new_tokens: int,
    shape: str,
    built,
    routing: bool = False,
) -> dict:
    import attrs
    import torch

    engine_mode = "dynamic" if mode in BASELINES else mode
    worker.config = attrs.evolve(
        worker.config, decode=engine_mode, batch_size=batch, decode_attention=attention
    )
    hf_infer_state(worker).decoders = None
    rng = random.Random(batch)
    vocab = hf_infer_state(worker).tokenizer.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    on_gpu = worker.device.startswith("cuda")
    routing = routing and mode not in BASELINES
    first = timed_generate(worker, prompts, new_tokens, mode, routing)[0]
    # The one-token call has a shape of its own: its first call allocates that decoder's cache,
    # as a run's first generation of each shape does (86-123 ms at 1.5B and 256 rows on an
    # H200, a later call 40 ms). Its time is taken from the timed call's: a cold one made the
    # decode look faster.
    timed_generate(worker, prompts, 1, mode, routing)
    ttft = timed_generate(worker, prompts, 1, mode, routing)[0]
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    total, responses, logprobs = timed_generate(worker, prompts, new_tokens, mode, routing)
    decode_s = max(total - ttft, 1e-9)
    steps = new_tokens - 1
    per_token = flops_per_token(shape, built.params, PROMPT_TOKENS + new_tokens, training=False)
    tflops = per_token * batch * steps / decode_s / 1e12
    peak = peak_bf16_tflops(device_name(worker.device))
    row = {
        "mode": mode if attention == "auto" else f"{mode} attention={attention}",
        "batch": batch,
        "first call s": first,
        "TTFT s": ttft,
        "total s": total,
        "decode tok/s": batch * steps / decode_s,
        "weights GB/s": built.nbytes * steps / decode_s / 1e9,
        "TFLOP/s": tflops,
        "% of peak": 100 * tflops / peak if peak else None,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "logp gap": worst_logprob_gap(worker, prompts, responses, logprobs),
    }
    hf_infer_state(worker).decoders = None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=[*BASELINES, "dynamic", "static", "cuda_graph", "compiled"],
        help="default: before hf_generate dynamic cuda_graph compiled on cuda, before dynamic "
        "static on cpu; the ratio column is against the first given",
    )
    parser.add_argument(
        "--attentions",
        nargs="+",
        default=["auto"],
        choices=["auto", "triton", "cudnn", "sdpa"],
        help="the fixed-shape modes once per strategy_config.decode_attention given",
    )
    parser.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="also time each mode with synced LoRA adapters of this rank on every attention "
        "and MLP linear (model_args.lora.sync: adapter), against the plain engine",
    )
    parser.add_argument(
        "--routing",
        action="store_true",
        help="the engine's generations return each sample's routing (mixture-of-experts shapes)",
    )
    args = parser.parse_args()
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    modes = args.modes or (
        ["before", "hf_generate", "dynamic", "cuda_graph", "compiled"]
        if args.device == "cuda"
        else ["before", "dynamic", "static"]
    )
    with tempfile.TemporaryDirectory() as model_dir:
        # On the GPU the weights are initialised there (the CPU takes minutes at 8B).
        built = build_model(args.shape, model_dir, dtype=dtype, device=args.device)
        worker = make_worker(model_dir, args.device, dtype)
        adapted = (
            make_worker(model_dir, args.device, dtype, args.adapter_rank)
            if args.adapter_rank
            else None
        )
        rows = []
        for batch in args.batches:
            baseline = None
            for mode in modes:
                static = mode not in (*BASELINES, "dynamic")
                for attention in args.attentions if static else ["auto"]:
                    row = measure(
                        worker,
                        mode,
                        attention,
                        batch,
                        args.new_tokens,
                        args.shape,
                        built,
                        args.routing,
                    )
                    baseline = baseline or row["decode tok/s"]
                    row[f"vs {modes[0]}"] = row["decode tok/s"] / baseline
                    if adapted is not None:
                        row["vs plain"] = None
                    rows.append(row)
                    print(f"{row['mode']} x {batch}: {row['decode tok/s']:,.0f} tok/s", flush=True)
                    if adapted is not None and mode not in BASELINES:
                        plain = row["decode tok/s"]
                        row = measure(
                            adapted, mode, attention, batch, args.new_tokens, args.shape, built
                        )
                        row["mode"] += f" +lora{args.adapter_rank}"
                        row[f"vs {modes[0]}"] = row["decode tok/s"] / baseline
                        row["vs plain"] = row["decode tok/s"] / plain
                        rows.append(row)
    print_table(
        rows,
        f"hf_infer generation: {args.shape} ({built.params / 1e9:.2f}B params, "
        f"{active_params(args.shape, built.params) / 1e9:.2f}B active, {dtype}) on "
        f"{device_name(args.device)}; {PROMPT_TOKENS} prompt + {args.new_tokens} new tokens "
        f"(forced), temperature 1",
        formats={
            "decode tok/s": ",.0f",
            "weights GB/s": ",.1f",
            "TFLOP/s": ",.1f",
            "% of peak": ".1f",
            "logp gap": ".1e",
            f"vs {modes[0]}": ".2f",
            "vs plain": ".2f",
        },
        text_columns=1,
    )


if __name__ == "__main__":
    main()
