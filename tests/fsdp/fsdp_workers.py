"""Rank functions run by the FSDP2 tests in spawned processes (importable by the children).

Each scenario builds :class:`WorkerContext` objects by hand, drives them through
:class:`WorkerRuntime` (so the plugin's hooks are what runs) and writes what the parent process
compares into ``out_dir`` with ``torch.save``.
"""

from __future__ import annotations

import os

MODEL = "preset:tiny-qwen2"
BATCH_ROWS = 8
STEPS = 3
SAVE_AFTER = 2


def launch(scenario: str, world_size: int, out_dir: str, timeout: float = 240.0, **kwargs):
    """Run ``scenario`` on ``world_size`` spawned ranks (gloo); raise on failure or timeout."""
    from posttrain.testing.spawn import run_ranks

    run_ranks(f"fsdp_workers:scenario_{scenario}", world_size, out_dir, timeout=timeout, **kwargs)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def hook_relay():
    import posttrain_fsdp.plugin
    from posttrain.testing.groups import engine_hook_relay

    return engine_hook_relay(posttrain_fsdp.plugin.plugin, "fsdp")


def make_runtime(
    rank: int, world_size: int, strategy: str = "fsdp2_train", config=None, **training
):
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain_fsdp.plugin import FSDP2InferConfig, FSDP2TrainConfig

    train = strategy == "fsdp2_train"
    if config is None:
        config = FSDP2TrainConfig(micro_batch_size=3) if train else FSDP2InferConfig()
    targs = {
        "learning_rate": 1e-3,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "cosine",
        "max_steps": 10,
        **training,
    }
    ctx = WorkerContext(
        role="actor_train" if train else "reference",
        strategy_name=strategy,
        config=config,
        model_args=ModelArgs(model_name_or_path=MODEL, disable_gradient_checkpointing=False),
        training_args=TrainingArgs(**targs) if train else None,
        rank=rank,
        world_size=world_size,
        algorithm=AlgorithmConfig(entropy_coef=1e-3),
        hook=hook_relay(),
    )
    runtime = WorkerRuntime(ctx)
    runtime.setup()
    return runtime


def step_batch(step: int, vocab: int):
    from posttrain.testing.batches import random_step_batch

    return random_step_batch(step, vocab, BATCH_ROWS)


def rank_share(batch, rank: int, world_size: int, rows: list[list[int]] | None = None):
    share = batch.select(rows[rank]) if rows else batch.split(world_size)[rank]
    share.meta["dp_size"] = world_size
    return share


def train_one(runtime, step: int, rank: int, world_size: int, rows=None) -> dict:
    """One RL step: old log-probs from the current model, then the policy update."""
    vocab = runtime.ctx.model.config.vocab_size
    share = rank_share(step_batch(step, vocab), rank, world_size, rows)
    old = runtime.compute_logprobs(share)
    # Perturb so the importance ratio is not exactly one (exercises clipping).
    share = share.with_tensors(old_logprobs=old + 0.05 * (share.response_mask - 0.5))
    return runtime.train_step(share)


def full_params(runtime) -> dict:
    """The full HF-named state dict on rank 0 (CPU, master dtype); empty on other ranks."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain_fsdp.engine import hf_name

    state = get_model_state_dict(
        runtime.ctx.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {hf_name(k): v for k, v in state.items()} if dist.get_rank() == 0 else {}


def full_optim(runtime) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from posttrain_fsdp.engine import FSDPState

    return get_optimizer_state_dict(
        runtime.ctx.model,
        runtime.ctx.engine_state(FSDPState).optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )


def probe_batch(vocab: int):
    import torch

    from posttrain.protocol import build_sequence_batch

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (4, 6, 3, 5)]
    responses = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 2, 7, 4)]
    return build_sequence_batch(prompts, responses, pad_token_id=0)


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


def scenario_train(rank: int, world_size: int, out_dir: str, extras: bool = False):
    """3 steps with fixed micro-batches; with ``extras``: a checkpoint and dumps after step 2,
    weight export, HF export, probe logits, then dynamic / uneven-share variants."""
    import torch

    def save(obj, name):
        if rank == 0:
            torch.save(obj, os.path.join(out_dir, name))

    rt = make_runtime(rank, world_size)
    metrics = []
    for step in range(STEPS):
        metrics.append(train_one(rt, step, rank, world_size))
        if extras and step + 1 == SAVE_AFTER:
            layout = rt.save_checkpoint(os.path.join(out_dir, "ckpt"))
            save(layout, "layout.pt")
            save(full_params(rt), "params_at_save.pt")
            save(full_optim(rt), "optim_at_save.pt")
    all_metrics = [None] * world_size
    torch.distributed.all_gather_object(all_metrics, metrics)
    save(all_metrics, f"metrics_w{world_size}.pt")
    save(full_params(rt), f"params_w{world_size}.pt")
    if not extras:
        return

    # Weight export, collectively; small buckets so there are many.
    rt.export_begin(bucket_bytes=64 * 1024)
    buckets = []
    while (bucket := rt.export_next()) is not None:
        buckets.append([(n, t.clone()) for n, t in bucket.tensors])
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, [len(b) for b in buckets])
    save({"buckets": buckets, "counts_per_rank": counts}, "export.pt")
    rt.export_hf(os.path.join(out_dir, "hf"))

    # Probe logits / log-probs of the trained model (forward is collective).
    probe = probe_batch(rt.ctx.model.config.vocab_size)
    with torch.no_grad():
        rt.ctx.model.eval()
        logits = rt.ctx.model(input_ids=probe.input_ids, attention_mask=probe.attention_mask).logits
        rt.ctx.model.train()
    save({"logits": logits, "logprobs": rt.compute_logprobs(probe)}, "probe.pt")

    # Dynamic micro-batches: a token budget that gives the ranks different micro-batch counts.
    dyn = make_runtime(rank, world_size, use_dynamic_batch_size=True, max_tokens_per_micro_batch=14)
    plans = []
    for step in range(STEPS):
        from posttrain.backend import plan_micro_batches

        share = rank_share(step_batch(step, dyn.ctx.model.config.vocab_size), rank, world_size)
        plans.append(plan_micro_batches(dyn.ctx, share, train=True))
        train_one(dyn, step, rank, world_size)
    all_plans = [None] * world_size
    torch.distributed.all_gather_object(all_plans, plans)
    save(all_plans, "dynamic_plans.pt")
    save(full_params(dyn), "params_dynamic.pt")

    # Uneven shares (7 rows / 1 row, micro-batch size 2): rank 1 runs zero-weight fillers.
    rows = [list(range(BATCH_ROWS - 1)), [BATCH_ROWS - 1]] if world_size == 2 else None
    from posttrain_fsdp.plugin import FSDP2TrainConfig

    uneven = make_runtime(rank, world_size, config=FSDP2TrainConfig(micro_batch_size=2))
    for step in range(STEPS):
        train_one(uneven, step, rank, world_size, rows=rows)
    save(full_params(uneven), "params_uneven.pt")

    # Chunked log-probs against the full logits, from fresh models.
    from posttrain.testing.logprob_chunks import chunked_vs_full

    chunked = chunked_vs_full(
        start=lambda chunk: make_runtime(
            rank,
            world_size,
            config=FSDP2TrainConfig(micro_batch_size=3, logprob_chunk_tokens=chunk),
        ),
        share_of=lambda rt: rank_share(
            step_batch(0, rt.ctx.model.config.vocab_size), rank, world_size
        ),
        train=lambda rt: train_one(rt, 0, rank, world_size),
    )
    save(chunked, "chunked.pt")


def scenario_resume(rank: int, world_size: int, out_dir: str):
    """Fresh ranks load the checkpoint written after step 2, dump state, run step 3."""
    import torch

    from posttrain_fsdp.engine import FSDPState

    def save(obj, name):
        if rank == 0:
            torch.save(obj, os.path.join(out_dir, name))

    rt = make_runtime(rank, world_size)
    rt.load_checkpoint(os.path.join(out_dir, "ckpt"))
    save(full_params(rt), "params_loaded.pt")
    save(full_optim(rt), "optim_loaded.pt")
    save(rt.ctx.engine_state(FSDPState).scheduler.get_last_lr(), "lr_loaded.pt")
    for step in range(SAVE_AFTER, STEPS):
        train_one(rt, step, rank, world_size)
    save(full_params(rt), "params_resumed.pt")

    # fsdp2_infer (reference role): log-probs of the initial weights, micro-batches of 3.
    from posttrain_fsdp.plugin import FSDP2InferConfig

    ref = make_runtime(rank, world_size, "fsdp2_infer", FSDP2InferConfig(micro_batch_size=3))
    probe = probe_batch(ref.ctx.model.config.vocab_size)
    save(ref.compute_logprobs(rank_share(probe, rank, world_size)), "ref_logprobs_rank0.pt")
    rt.shutdown()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a DTensor counts its local shard; a
    storage several tensors view is counted once)."""
    storages = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def scenario_memory(rank: int, world_size: int, out_dir: str, param_dtypes=(None,)):
    """One step for each compute dtype of ``param_dtypes`` (None: the model's, fp32); what the
    trainer holds, by part: weights and optimizer state after the step, gradients when the
    optimizer steps (their peak) and after the step. Writes ``memory_{param_dtype}.pt``."""
    import torch

    from posttrain_fsdp.engine import FSDPState
    from posttrain_fsdp.plugin import FSDP2TrainConfig

    for param_dtype in param_dtypes:
        config = FSDP2TrainConfig(micro_batch_size=3, param_dtype=param_dtype)
        rt = make_runtime(rank, world_size, config=config)
        model, optimizer = rt.ctx.model, rt.ctx.engine_state(FSDPState).optimizer
        params = list(model.parameters())
        measured = {}

        def at_step(opt, args, kwargs, params=params, measured=measured):
            measured["grads_at_step"] = storage_bytes(p.grad for p in params)

        optimizer.register_step_pre_hook(at_step)
        train_one(rt, 0, rank, world_size)
        measured["weights"] = storage_bytes(params)
        measured["grads"] = storage_bytes(p.grad for p in params)
        measured["optimizer"] = storage_bytes(
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, measured)
        if rank == 0:
            torch.save(everyone, os.path.join(out_dir, f"memory_{param_dtype}.pt"))
