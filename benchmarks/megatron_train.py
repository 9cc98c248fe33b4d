"""Training throughput of ``megatron_train`` on one GPU against two baselines, same shape, same run:

* ``megatron_train``: the plugin's own path: the HF config saved to a temp dir (config only:
  random init), ``engine.setup_parallel`` + ``engine.load_model`` (mbridge model from the plugin's
  layer spec, SDPA core attention + torch fused norms without TransformerEngine, megatron DDP and
  the Float16 optimizer: bf16 params, fp32 main params and grads, Adam), steps through
  ``engine.train_step`` with core's ``PolicyLoss`` (next-token log-probs and entropy from the
  logits in one pass, Triton kernels of ``token_scores``), then the time to export every weight
  in 512 MiB buckets (``weights.export_weights``: gathered HF-named tensors copied to host
  memory);
* ``megatron_local``: a plain megatron-core loop, no plugin code: ``GPTModel`` with
  ``get_gpt_layer_local_spec`` (unfused attention), Float16Module + DDP (fp32 grads), megatron's
  optimizer (same settings), ``get_forward_backward_func`` with the model's own cross entropy;
* ``transformers``: ``Qwen2ForCausalLM`` (``attn_implementation="sdpa"``) in bf16,
  ``torch.optim.AdamW(fused=True)`` on the bf16 parameters, HF's causal-LM loss, grad clipping.
* ``megatron_packing``: ``megatron_train`` on one micro-batch of rows of uneven length (8 rows,
  lengths uniform in [256, 2048]), right-padded and with ``pack_sequences`` (real tokens / s).

Every row clips gradients to norm 1.0 (as megatron_train's default ``max_grad_norm``). Tokens are
random, sequences full length (no padding). Each row runs in its own process (memory isolation).

    python benchmarks/megatron_train.py                     # Qwen2-1.5B shape, 2x4096 and 4x2048
    python benchmarks/megatron_train.py --tiny              # a tiny shape; runs on CPU in seconds
    python benchmarks/megatron_train.py --rows megatron_train,transformers --steps 5

FLOPs per token = 6 * N + 6 * L * h * s, with N the model's parameters (the tied embedding
counted once: it is the output layer's matmul; the lookup costs nothing), L layers, h the
attention width (heads x head_dim), s the sequence length: 6 * N for the forward and backward
matmuls, 6 * L * h * s for causal attention (QK^T and AV, 4 * s * h per token and layer
forward, halved by the causal mask, times 3 for forward + backward). TFLOP/s = tokens/step x
FLOPs per token / seconds per step; MFU = TFLOP/s / 989 (dense bf16 peak of an H100 / H200 SXM).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

from shapes import SHAPES as SHAPE_SIZES

# Megatron builds rotary tables for the model's longest position: the benchmark's sequences.
MAX_POSITIONS = {"qwen2-1.5b": 32768, "tiny": 256}
SHAPES = {
    name: {**SHAPE_SIZES[name], "max_position_embeddings": n} for name, n in MAX_POSITIONS.items()
}
# (sequences, tokens per sequence) per step.
BATCHES = {"qwen2-1.5b": [(2, 4096), (4, 2048)], "tiny": [(2, 64), (4, 32)]}
# megatron_packing: (rows, longest row) of one micro-batch of uneven rows (lengths uniform in
# [longest / 8, longest]), right-padded vs packed.
PACKING = {"qwen2-1.5b": (8, 2048), "tiny": (4, 64)}
ROWS = ("megatron_train", "megatron_local", "transformers", "megatron_packing")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM
EXPORT_BUCKET_BYTES = 512 << 20
PROMPT_TOKENS = 16


def hf_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(
        **SHAPES[shape],
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        use_cache=False,
        dtype="bfloat16",
    )


def param_count(shape: str) -> int:
    """Parameters of the HF model (tied embedding once), counted on the meta device."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(hf_config(shape))
    return sum(p.numel() for p in model.parameters())


def flops_per_token(shape: str, seq: int, params: int) -> float:
    cfg = SHAPES[shape]
    return 6.0 * params + 6.0 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


def random_tokens(rows: int, seq: int, vocab: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (rows, seq), generator=gen)


# --------------------------------------------------------------------------------------------
# Rows (each runs in a child process)
# --------------------------------------------------------------------------------------------


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(step, dev, warmup: int, steps: int) -> tuple[float, float]:
    """Mean seconds per step over ``steps`` timed steps after ``warmup``; peak GiB allocated."""
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    _sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(dev)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    return seconds, peak


def _profile(step, dev, path: str) -> None:
    """One profiled step: the kernels that take the time (``--profile-dir``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    del prof
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _time_shapes(args, dev, emit, row: str, make_step, backend: str, params: int, grad_norm):
    """Time ``make_step(rows, seq)``'s step at every batch shape and emit one result per shape
    (``grad_norm()`` read after the timed steps); ``--profile-dir``: one profiled step each."""
    for rows, seq in BATCHES[args.shape]:
        step = make_step(rows, seq)
        seconds, peak = _time_steps(step, dev, args.warmup, args.steps)
        emit(
            rows=rows,
            seq=seq,
            seconds=seconds,
            peak=peak,
            params=params,
            backend=backend,
            grad_norm=grad_norm(),
        )
        if args.profile_dir:
            _profile(step, dev, os.path.join(args.profile_dir, f"{row}_{rows}x{seq}.txt"))


def _init_dist(dev) -> None:
    import torch
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")


def _megatron_worker(args, dev):
    """A megatron_train worker on one device through the plugin's own path (random init)."""
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_megatron import bridge as plugin_bridge
    from posttrain_megatron import engine
    from posttrain_megatron.config import MegatronTrainConfig

    tmp = tempfile.mkdtemp(prefix="megatron-bench-")
    hf_config(args.shape).save_pretrained(tmp)  # config only: no weights on disk

    # Random init: build_models would load HF weights from the directory, which holds none.
    # Everything else (spec, overrides, DDP, optimizer, train_step, export) is the plugin's.
    make_bridge = plugin_bridge.make_bridge

    def make_bridge_without_weights(*a, **kw):
        bridge = make_bridge(*a, **kw)
        bridge.load_weights = lambda *a, **kw: None
        return bridge

    plugin_bridge.make_bridge = make_bridge_without_weights
    worker = WorkerContext(
        role="actor_train",
        strategy_name="megatron_train",
        config=MegatronTrainConfig(),
        model_args=ModelArgs(model_name_or_path=tmp, dtype="bf16"),
        training_args=TrainingArgs(learning_rate=1e-5, max_grad_norm=1.0),
        device=dev.type,
        seed=0,
        run_dir=tmp,
        base_dir=tmp,
        algorithm=AlgorithmConfig(),
    )
    worker.parallel = engine.setup_parallel(worker)
    worker.model = engine.load_model(worker)
    return worker


def _rl_batch(ids: list[list[int]], vocab: int):
    """An RL training batch of these token rows (their first PROMPT_TOKENS are the prompt)."""
    import torch

    from posttrain.protocol import build_sequence_batch

    rows = len(ids)
    batch = build_sequence_batch(
        [r[:PROMPT_TOKENS] for r in ids], [r[PROMPT_TOKENS:] for r in ids], pad_token_id=0
    )
    gen = torch.Generator().manual_seed(1)
    batch = batch.with_tensors(
        # About a random-init model's log-probs: ratios near 1, inside the clip range.
        old_logprobs=torch.full_like(batch.response_mask, -math.log(vocab)),
        advantages=torch.randn(rows, 1, generator=gen) * batch.response_mask,
    )
    batch.meta.update(
        global_tokens=float(batch.response_mask.sum()), global_seqs=float(rows), dp_size=1
    )
    return batch


def row_megatron_train(args, dev, emit) -> None:
    import attrs

    from posttrain.algorithms.policy_loss import PolicyLoss
    from posttrain_megatron import engine, weights
    from posttrain_megatron.model_builder import attention_backend

    worker = _megatron_worker(args, dev)
    params = sum(p.numel() for m in worker.model for p in m.parameters())
    backend = attention_backend(worker.config.attention_backend)
    loss_fn = PolicyLoss(worker.algorithm)
    vocab = SHAPES[args.shape]["vocab_size"]

    def make_step(rows: int, seq: int):
        worker.config = attrs.evolve(worker.config, micro_batch_size=rows)  # one micro-batch
        batch = _rl_batch(random_tokens(rows, seq, vocab).tolist(), vocab)

        def step():
            last.update(engine.train_step(worker, batch, loss_fn))

        return step

    last: dict = {}
    _time_shapes(
        args,
        dev,
        emit,
        "megatron_train",
        make_step,
        backend,
        params,
        lambda: last.get("actor/grad_norm"),
    )

    # Export every weight in buckets (collective gathers, copies to host memory).
    passes = []
    for _ in range(2):
        _sync(dev)
        start = time.perf_counter()
        nbytes = tensors = buckets = 0
        for bucket in weights.export_weights(worker, bucket_bytes=EXPORT_BUCKET_BYTES):
            buckets += 1
            tensors += len(bucket.tensors)
            nbytes += bucket.nbytes
            del bucket
        passes.append(time.perf_counter() - start)
    emit(export=True, nbytes=nbytes, tensors=tensors, buckets=buckets, seconds=passes)
    engine.shutdown_worker(worker)


def row_megatron_packing(args, dev, emit) -> None:
    """One micro-batch of rows of uneven length, right-padded and packed (pack_sequences)."""
    import attrs
    import torch

    from posttrain.algorithms.policy_loss import PolicyLoss
    from posttrain_megatron import engine

    rows, longest = PACKING[args.shape]
    worker = _megatron_worker(args, dev)
    loss_fn = PolicyLoss(worker.algorithm)
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(longest // 8, longest + 1, (rows,), generator=gen).tolist()
    lengths[0] = longest  # the padded width
    tokens = random_tokens(rows, longest, vocab).tolist()
    batch = _rl_batch([r[:n] for r, n in zip(tokens, lengths)], vocab)
    for packed in (False, True):
        worker.config = attrs.evolve(worker.config, micro_batch_size=rows, pack_sequences=packed)
        seconds, peak = _time_steps(
            lambda: engine.train_step(worker, batch, loss_fn), dev, args.warmup, args.steps
        )
        emit(
            packing=True,
            packed=packed,
            rows=rows,
            width=longest,
            tokens=sum(lengths),
            seconds=seconds,
            peak=peak,
        )
    engine.shutdown_worker(worker)


def row_megatron_local(args, dev, emit) -> None:
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    _init_dist(dev)
    cpu = dev.type == "cpu"
    if cpu:  # CPU check of this script only: megatron-core hard-codes CUDA (test support)
        from posttrain_megatron import cpu_support

        cpu_support.apply()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    shape = SHAPES[args.shape]
    config = TransformerConfig(
        num_layers=shape["num_hidden_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_key_value_heads"],
        ffn_hidden_size=shape["intermediate_size"],
        kv_channels=shape["hidden_size"] // shape["num_attention_heads"],
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Fusions that need TransformerEngine / apex / compiled extensions: off, as in the plugin.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=cpu,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape["vocab_size"],
        max_sequence_length=shape["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=1_000_000,
        share_embeddings_and_output_weights=True,
    )
    params = sum(p.numel() for p in model.parameters())
    if not cpu:
        model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            min_lr=0.0,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
        ),
        [model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    def make_step(rows: int, seq: int):
        ids = random_tokens(rows, seq, shape["vocab_size"]).to(dev)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(seq, device=dev).unsqueeze(0).expand_as(ids)

        def loss_func(output):
            mean = output.float().mean()
            return mean, {"lm loss": mean.detach()}

        def forward_step(data_iterator, model):
            # labels given: the model returns the per-token cross entropy [b, s]
            return model(ids, positions, None, labels=labels), loss_func

        def step():
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter([None]),
                model=model,
                num_microbatches=1,
                seq_length=seq,
                micro_batch_size=rows,
                forward_only=False,
            )
            _, grad_norm, _ = optimizer.step()
            last.update(loss=float(losses[0]["lm loss"]), grad_norm=float(grad_norm))

        return step

    last: dict = {}
    _time_shapes(
        args, dev, emit, "megatron_local", make_step, "local", params, lambda: last.get("grad_norm")
    )
    ps.destroy_model_parallel()


def row_transformers(args, dev, emit) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(
            hf_config(args.shape), attn_implementation="sdpa", dtype=torch.bfloat16
        )
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)

    def make_step(rows: int, seq: int):
        ids = random_tokens(rows, seq, SHAPES[args.shape]["vocab_size"]).to(dev)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            last["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    last: dict = {}
    _time_shapes(
        args, dev, emit, "transformers", make_step, "sdpa", params, lambda: float(last["grad_norm"])
    )


ROW_FUNCS = {
    "megatron_train": row_megatron_train,
    "megatron_packing": row_megatron_packing,
    "megatron_local": row_megatron_local,
    "transformers": row_transformers,
}


def child(args) -> int:
    import torch

    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    def emit(**result):
        print("RESULT " + json.dumps({"row": args.child, **result}), flush=True)

    ROW_FUNCS[args.child](args, dev, emit)
    gc.collect()
    return 0


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(row: str, args) -> tuple[list[dict], str]:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        row,
        "--shape",
        args.shape,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    note = f"{row}: exit {proc.returncode} in {time.perf_counter() - start:.0f} s"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        note += "\n" + tail
    return results, note


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ",".join(ROWS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per shape")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU check)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES))
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--profile-dir", default=None, help="write one profiled step per row")
    parser.add_argument("--child", default=None, choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shape is None:
        args.shape = "tiny" if args.tiny else "qwen2-1.5b"
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    if args.child:
        return child(args)

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {sorted(unknown)}")
    import torch

    name = device_name(args.device)
    params = param_count(args.shape)
    print(
        f"megatron_train benchmark: {args.shape} ({params / 1e9:.3f}B params, tied embedding), "
        f"bf16, 1 x {name}; torch {torch.__version__}; {args.warmup} warm-up + {args.steps} "
        f"timed steps per shape",
        flush=True,
    )
    results: list[dict] = []
    failed = False
    for row in rows:
        got, note = run_row(row, args)
        print(note, flush=True)
        failed |= "exit 0 " not in note
        results += got

    peak = peak_tflops(name)
    train = [r for r in results if not r.get("export") and not r.get("packing")]
    base = {(r["rows"], r["seq"]): r for r in train if r["row"] == "transformers"}
    columns = [
        ("row", 15, "<"),
        ("attention", 9, "<"),
        ("tokens/step", 11, ">"),
        ("s/step", 7, ">"),
        ("tokens/s", 9, ">"),
        ("TFLOP/s", 7, ">"),
        ("MFU", 6, ">"),
        ("peak GiB", 8, ">"),
        ("vs transformers", 15, ">"),
        ("grad norm", 9, ">"),
    ]

    def line(cells) -> str:
        return "| " + " | ".join(f"{c:{a}{w}}" for c, (_, w, a) in zip(cells, columns)) + " |"

    print("\n" + line([name for name, _, _ in columns]))
    print(
        "| "
        + " | ".join("-" * w if a == "<" else "-" * (w - 1) + ":" for _, w, a in columns)
        + " |"
    )
    for rows_, seq in BATCHES[args.shape]:
        for r in train:
            if (r["rows"], r["seq"]) != (rows_, seq):
                continue
            tps = rows_ * seq / r["seconds"]
            tflops = tps * flops_per_token(args.shape, seq, params) / 1e12
            ref = base.get((rows_, seq))
            print(
                line(
                    [
                        r["row"],
                        r["backend"],
                        f"{rows_}x{seq}",
                        f"{r['seconds']:.3f}",
                        f"{tps:.0f}",
                        f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}",
                        f"{100 * tflops / peak:.1f}%" if peak else "n/a",
                        f"{r['peak']:.1f}",
                        f"{ref['seconds'] / r['seconds']:.2f}x" if ref else "n/a",
                        f"{r['grad_norm']:.3g}" if r.get("grad_norm") is not None else "n/a",
                    ]
                )
            )
    ours = {(r["rows"], r["seq"]): r for r in train if r["row"] == "megatron_train"}
    ratios = [base[k]["seconds"] / ours[k]["seconds"] for k in ours if k in base]
    if ratios:
        verdict = "met" if min(ratios) >= 1.0 else "NOT met"
        print(
            f"\nmegatron_train / transformers throughput >= 1.0: {verdict} "
            f"({', '.join(f'{x:.2f}x' for x in ratios)})"
        )
    for r in train:
        if r["params"] != params:
            print(f"note: {r['row']} built {r['params']} parameters (HF count {params})")
    for r in results:
        if r.get("export"):
            first, best = r["seconds"][0], min(r["seconds"])
            print(
                f"\nexport_weights ({EXPORT_BUCKET_BYTES >> 20} MiB buckets): {r['tensors']} "
                f"tensors, {r['buckets']} buckets, {r['nbytes'] / 1e9:.2f} GB in {best:.2f} s = "
                f"{r['nbytes'] / 1e9 / best:.2f} GB/s (first pass {first:.2f} s = "
                f"{r['nbytes'] / 1e9 / first:.2f} GB/s)"
            )
    packing = {r["packed"]: r for r in results if r.get("packing")}
    if len(packing) == 2:
        first = packing[False]
        print(
            f"\npack_sequences ({first['rows']} rows of uneven length, longest {first['width']}: "
            f"{first['tokens']} real tokens, {first['rows'] * first['width']} padded):"
        )
        for packed, r in sorted(packing.items()):
            print(
                f"  {'packed' if packed else 'padded'}: {r['seconds']:.3f} s/step, "
                f"{r['tokens'] / r['seconds']:.0f} real tokens/s, peak {r['peak']:.1f} GiB"
                + (f", {first['seconds'] / r['seconds']:.2f}x" if packed else "")
            )
    print(
        f"\nFLOPs/token = 6 x {params} + 6 x layers x hidden x seq (causal attention); MFU "
        f"against {peak or 'n/a'} TFLOP/s dense bf16; 'vs transformers' = its s/step / this "
        f"row's s/step."
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
