"""The rows of benchmarks/megatron_train.py that go through the plugin (``megatron_train``,
``megatron_packing``), and what every row shares: the shapes' settings and the timing. Each row
runs in a child process of its own (``megatron_train.py --child ROW``) and reports to the driver
through ``emit`` (``RESULT {json}`` lines)."""

from __future__ import annotations

import math
import os
import tempfile
import time

from common import SHAPES

# Megatron builds rotary tables for the model's longest position: the benchmark's sequences.
MAX_POSITIONS = {"qwen2-1.5b": 32768, "tiny": 256}
# (sequences, tokens per sequence) per step.
BATCHES = {"qwen2-1.5b": [(2, 4096), (4, 2048)], "tiny": [(2, 64), (4, 32)]}
# megatron_packing: (rows, longest row) of one micro-batch of uneven rows (lengths uniform in
# [longest / 8, longest]), right-padded vs packed.
PACKING = {"qwen2-1.5b": (8, 2048), "tiny": (4, 64)}
EXPORT_BUCKET_BYTES = 512 << 20
PROMPT_TOKENS = 16


def shape_config(shape: str) -> dict:
    """The sizes of ``shape`` and its longest position."""
    return {**SHAPES[shape], "max_position_embeddings": MAX_POSITIONS[shape]}


def hf_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(
        **shape_config(shape),
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        use_cache=False,
        dtype="bfloat16",
    )


def random_tokens(rows: int, seq: int, vocab: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (rows, seq), generator=gen)


def sync_device(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, dev, warmup: int, steps: int) -> tuple[float, float]:
    """Mean seconds per step over ``steps`` timed steps after ``warmup``; peak GiB allocated."""
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    sync_device(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync_device(dev)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    return seconds, peak


def profile_step(step, dev, path: str) -> None:
    """One profiled step: the kernels that take the time (``--profile-dir``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync_device(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    del prof
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def time_shapes(args, dev, emit, row: str, make_step, backend: str, params: int, grad_norm):
    """Time ``make_step(rows, seq)``'s step at every batch shape and emit one result per shape
    (``grad_norm()`` read after the timed steps); ``--profile-dir``: one profiled step each."""
    for rows, seq in BATCHES[args.shape]:
        step = make_step(rows, seq)
        seconds, peak = time_steps(step, dev, args.warmup, args.steps)
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
            profile_step(step, dev, os.path.join(args.profile_dir, f"{row}_{rows}x{seq}.txt"))


def megatron_worker(args, dev):
    """A megatron_train worker on one device through the plugin's own path (random init)."""
    from posttrain import ModelArgs, TrainingArgs, WorkerContext
    from posttrain.config.sections import AlgorithmConfig
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


def rl_batch(ids: list[list[int]], vocab: int):
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

    worker = megatron_worker(args, dev)
    params = sum(p.numel() for m in worker.model for p in m.parameters())
    backend = attention_backend(worker.config.attention_backend)
    loss_fn = PolicyLoss(worker.algorithm)
    vocab = SHAPES[args.shape]["vocab_size"]

    def make_step(rows: int, seq: int):
        worker.config = attrs.evolve(worker.config, micro_batch_size=rows)  # one micro-batch
        batch = rl_batch(random_tokens(rows, seq, vocab).tolist(), vocab)

        def step():
            last.update(engine.train_step(worker, batch, loss_fn))

        return step

    last: dict = {}
    time_shapes(
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
        sync_device(dev)
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
    worker = megatron_worker(args, dev)
    loss_fn = PolicyLoss(worker.algorithm)
    vocab = SHAPES[args.shape]["vocab_size"]
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(longest // 8, longest + 1, (rows,), generator=gen).tolist()
    lengths[0] = longest  # the padded width
    tokens = random_tokens(rows, longest, vocab).tolist()
    batch = rl_batch([r[:n] for r, n in zip(tokens, lengths)], vocab)
    for packed in (False, True):
        worker.config = attrs.evolve(worker.config, micro_batch_size=rows, pack_sequences=packed)
        seconds, peak = time_steps(
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
