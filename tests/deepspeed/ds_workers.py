"""Rank functions run by the DeepSpeed tests in spawned processes (importable by the children).

Each scenario builds :class:`WorkerContext` objects by hand, drives them through
:class:`WorkerRuntime` (so the plugin's hooks are what runs) and writes what the parent process
compares into ``out_dir`` with ``torch.save``.
"""

from __future__ import annotations

import os

MODEL = "preset:tiny-qwen2"
BATCH_ROWS = 8
STEPS = 3


def launch(scenario: str, world_size: int, out_dir: str, timeout: float = 300.0, **kwargs):
    """Run ``scenario`` on ``world_size`` spawned ranks (gloo); raise on failure or timeout."""
    from posttrain.testing.spawn import run_ranks

    run_ranks(f"ds_workers:scenario_{scenario}", world_size, out_dir, timeout=timeout, **kwargs)


def hook_relay():
    import posttrain_deepspeed.plugin
    from posttrain.testing.groups import engine_hook_relay

    return engine_hook_relay(posttrain_deepspeed.plugin.plugin, "deepspeed")


def make_runtime(
    rank: int, world_size: int, strategy="deepspeed_train", config=None, dtype="fp32", **training
):
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain_deepspeed.config import DeepSpeedInferConfig, DeepSpeedTrainConfig

    train = strategy == "deepspeed_train"
    if config is None:
        config = DeepSpeedTrainConfig(micro_batch_size=3) if train else DeepSpeedInferConfig()
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
        model_args=ModelArgs(
            model_name_or_path=MODEL, disable_gradient_checkpointing=False, dtype=dtype
        ),
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


def rank_share(batch, rank: int, world_size: int, rows=None):
    share = batch.select(rows[rank]) if rows else batch.split(world_size)[rank]
    share.meta["dp_size"] = world_size
    return share


def train_one(runtime, step: int, rank: int, world_size: int, rows=None) -> dict:
    """One RL step: old log-probs from the current model, then the policy update."""
    vocab = runtime.ctx.model.module.config.vocab_size
    share = rank_share(step_batch(step, vocab), rank, world_size, rows)
    old = runtime.compute_logprobs(share)
    share = share.with_tensors(old_logprobs=old + 0.05 * (share.response_mask - 0.5))
    return runtime.train_step(share)


def full_params(runtime) -> dict:
    from posttrain_deepspeed.engine import full_state_dict

    return full_state_dict(runtime.ctx)


def _config(stage: int, **kw):
    from posttrain_deepspeed.config import DeepSpeedTrainConfig

    return DeepSpeedTrainConfig(zero_stage=stage, micro_batch_size=3, **kw)


def scenario_train(rank: int, world_size: int, out_dir: str, stage: int, extras: bool = False):
    """3 steps with fixed micro-batches; with ``extras``: weight export in both modes, HF export,
    then dynamic / uneven-share variants."""
    import torch

    def save(obj, name):
        if rank == 0:
            torch.save(obj, os.path.join(out_dir, name))

    rt = make_runtime(rank, world_size, config=_config(stage))
    metrics = []
    for step in range(STEPS):
        metrics.append(train_one(rt, step, rank, world_size))
    all_metrics = [None] * world_size
    torch.distributed.all_gather_object(all_metrics, metrics)
    save(all_metrics, f"metrics_w{world_size}.pt")
    save(full_params(rt), f"params_w{world_size}.pt")
    if not extras:
        return

    # Weight export (small buckets: many of them), through the hook: rank 0 on the host.
    rt.export_begin(bucket_bytes=64 * 1024)
    buckets = []
    while (bucket := rt.export_next()) is not None:
        buckets.append([(n, t.clone()) for n, t in bucket.tensors])
    counts = [None] * world_size
    torch.distributed.all_gather_object(counts, [len(b) for b in buckets])
    save({"buckets": buckets, "counts_per_rank": counts}, "export.pt")
    # In-process export (hybrid engine): every rank gets every tensor.
    from posttrain_deepspeed.engine import export_weights

    got = {}
    for bucket in export_weights(rt.ctx, 64 * 1024, on_device=True):
        for name, tensor in bucket.tensors:
            got[name] = (str(tensor.device), tensor.dtype, tensor.clone())
    torch.save(got, os.path.join(out_dir, f"export_in_process_rank{rank}.pt"))
    rt.export_hf(os.path.join(out_dir, "hf"))
    # What release_memory would hand to engine.offload_states on a GPU: DeepSpeed's own names.
    from posttrain_deepspeed.engine import _offload_kinds

    save([k.value for k in _offload_kinds(["weights", "grads", "optimizer"])], "offload.pt")

    # Dynamic micro-batches: a token budget that gives the ranks different micro-batch counts.
    dyn = make_runtime(
        rank,
        world_size,
        config=_config(stage),
        use_dynamic_batch_size=True,
        max_tokens_per_micro_batch=14,
    )
    plans = []
    from posttrain.backend import plan_micro_batches

    for step in range(STEPS):
        vocab = dyn.ctx.model.module.config.vocab_size
        share = rank_share(step_batch(step, vocab), rank, world_size)
        plans.append(plan_micro_batches(dyn.ctx, share, train=True))
        train_one(dyn, step, rank, world_size)
    all_plans = [None] * world_size
    torch.distributed.all_gather_object(all_plans, plans)
    save(all_plans, "dynamic_plans.pt")
    save(full_params(dyn), "params_dynamic.pt")

    # Uneven shares (7 rows / 1 row, micro-batch size 2): rank 1 runs zero-weight fillers.
    from posttrain_deepspeed.config import DeepSpeedTrainConfig

    rows = [list(range(BATCH_ROWS - 1)), [BATCH_ROWS - 1]] if world_size == 2 else None
    uneven = make_runtime(
        rank, world_size, config=DeepSpeedTrainConfig(zero_stage=stage, micro_batch_size=2)
    )
    for step in range(STEPS):
        train_one(uneven, step, rank, world_size, rows=rows)
    save(full_params(uneven), "params_uneven.pt")

    # Chunked log-probs against the full logits, from fresh models.
    from posttrain.testing.logprob_chunks import chunked_vs_full

    chunked = chunked_vs_full(
        start=lambda chunk: make_runtime(
            rank, world_size, config=_config(stage, logprob_chunk_tokens=chunk)
        ),
        share_of=lambda rt: rank_share(
            step_batch(0, rt.ctx.model.module.config.vocab_size), rank, world_size
        ),
        train=lambda rt: train_one(rt, 0, rank, world_size),
    )
    save(chunked, "chunked.pt")


def _reachable(obj, path="", depth=0, seen=None):
    """``(path, tensor)`` for every tensor reachable from a DeepSpeed object: its attributes,
    lists and dicts, a torch optimizer's state and groups, a tensor's ``.grad``."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield f"{path}.grad", obj.grad
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, torch.optim.Optimizer) or (
        type(obj).__module__.startswith("deepspeed") and not isinstance(obj, torch.nn.Module)
    ):
        items = vars(obj).items()
    else:
        return
    for key, value in items:
        yield from _reachable(value, f"{path}.{key}", depth + 1, seen)


def held_bytes(engine) -> dict[str, int]:
    """What a DeepSpeed engine holds, by part, in bytes of distinct storages: ``weights`` (the
    module's parameters: ZeRO-1/2's flat buffer, ZeRO-3's partitions and its persistent whole
    parameters), ``optimizer`` (the float32 master partitions the inner optimizer steps and
    AdamW's state) and ``grads`` (every other tensor the ZeRO optimizer keeps under a name of
    gradients or of its reduce buckets)."""
    import torch

    parts: dict[str, dict[int, int]] = {"weights": {}, "optimizer": {}, "grads": {}}
    owner: dict[int, str] = {}

    def add(part, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owner:
            owner[storage.data_ptr()] = part
            parts[part][storage.data_ptr()] = storage.nbytes()

    for param in engine.module.parameters():
        add("weights", param.data)
        if getattr(param, "ds_tensor", None) is not None:
            add("weights", param.ds_tensor)
    zero = engine.optimizer
    # The float32 master partitions (ZeRO-3 hands them to the inner optimizer only in its step).
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for master in getattr(zero, name, None) or []:
            add("optimizer", master)
    inner = zero.optimizer
    for group in inner.param_groups:
        for master in group["params"]:
            add("optimizer", master)
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                add("optimizer", value)
    for path, tensor in _reachable(zero):
        if "grad" in path.lower() or "ipg" in path.lower():
            add("grads", tensor)
    return {part: sum(storages.values()) for part, storages in parts.items()}


def scenario_memory(rank, world_size, out_dir, runs, reduce_bucket_size):
    """One step for each ``(ZeRO stage, dtype)`` of ``runs``; what the engine holds by part
    after it, the gradients also when the ZeRO optimizer steps, and the largest reduce buckets
    backward allocated (ZeRO-1/2). Writes ``memory_z{stage}_{dtype}.pt``: parts per rank."""
    import torch

    for stage, dtype in runs:
        config = _config(stage, reduce_bucket_size=reduce_bucket_size)
        rt = make_runtime(rank, world_size, config=config, dtype=dtype)
        engine = rt.ctx.model
        zero = engine.optimizer
        measured = {"buckets": 0}
        step = zero.step

        def at_step(*args, step=step, measured=measured, engine=engine, **kwargs):
            measured["grads_at_step"] = held_bytes(engine)["grads"]
            return step(*args, **kwargs)

        zero.step = at_step
        if stage < 3:
            setup = zero.setup_buckets

            def buckets(setup=setup, measured=measured, zero=zero):
                setup()
                held = sum(
                    b.untyped_storage().nbytes()
                    for bucket in zero.ipg_buckets.values()
                    for b in bucket.buffer
                )
                measured["buckets"] = max(measured["buckets"], held)

            zero.setup_buckets = buckets
        train_one(rt, 0, rank, world_size)
        measured.update(held_bytes(engine))
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, measured)
        if rank == 0:
            torch.save(everyone, os.path.join(out_dir, f"memory_z{stage}_{dtype}.pt"))
        del rt, engine, zero  # not shutdown(): that ends the process group the next one needs
