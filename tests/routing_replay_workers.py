"""Rank function of the routing-replay tests of the HF trainers (tests/fsdp and tests/deepspeed,
``test_*_routing_replay.py``), run in a spawned process: the trainer and hf_infer on the tiny MoE
preset, in one process as in the hybrid engine, weights synced in process."""

from __future__ import annotations

import os

MOE = "preset:tiny-qwen3-moe"
EXPERTS = 8  # the preset's, per MoE layer


def _trainer(name: str):
    """The trainer's plugin, its strategy config (one scoring pass over the whole batch, the
    rows in order: they are equally long) and its engine-state class."""
    if name == "fsdp2_train":
        import posttrain_fsdp.plugin
        from posttrain_fsdp.engine import FSDPState

        config = posttrain_fsdp.plugin.FSDP2TrainConfig(
            micro_batch_size=8, logprob_micro_batch_size=64
        )
        return posttrain_fsdp.plugin.plugin, config, FSDPState
    import posttrain_deepspeed.plugin
    from posttrain_deepspeed.config import DeepSpeedTrainConfig
    from posttrain_deepspeed.engine import DeepSpeedState

    config = DeepSpeedTrainConfig(micro_batch_size=8, logprob_micro_batch_size=64)
    return posttrain_deepspeed.plugin.plugin, config, DeepSpeedState


def _runtimes(rank: int, world_size: int, trainer: str, dtype: str, infer_dtype: str):
    import attrs

    import posttrain_hf_infer.plugin
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain.testing.groups import engine_hook_relay
    from posttrain_hf_infer.plugin import HFInferConfig

    plugin, config, _ = _trainer(trainer)
    model_args = ModelArgs(model_name_or_path=MOE, dtype=dtype)
    algorithm = AlgorithmConfig(routing_replay="rollout", old_logprobs="recompute")
    train = WorkerContext(
        role="actor_train",
        strategy_name=trainer,
        config=config,
        model_args=model_args,
        training_args=TrainingArgs(learning_rate=1e-2, max_steps=10),
        rank=rank,
        world_size=world_size,
        algorithm=algorithm,
        hook=engine_hook_relay(plugin, trainer),
    )
    infer = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=HFInferConfig(),
        model_args=attrs.evolve(model_args, dtype=infer_dtype),
        rank=rank,
        world_size=world_size,
        algorithm=algorithm,
        hook=engine_hook_relay(posttrain_hf_infer.plugin.plugin, "hf_infer"),
    )
    runtimes = []
    for ctx in (train, infer):
        runtime = WorkerRuntime(ctx)
        runtime.setup()
        runtimes.append(runtime)
    return runtimes


def _rollout(infer, seed: int):
    from posttrain import GenerationRequest, SamplingParams
    from posttrain.protocol import build_sequence_batch
    from posttrain.testing.batches import PROMPTS, on_policy_train_batch

    # Equal prompt lengths and ignore_eos: every row is as long, one micro-batch in order.
    sampling = SamplingParams(n=4, max_new_tokens=3, ignore_eos=True)
    samples = infer.generate(GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=seed))
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        0,
        samples.response_logprobs,
        routing=samples.routing,
    )
    return on_policy_train_batch(batch, seed)


def _gap(trainer, rollout, mask) -> dict[str, float]:
    diff = (trainer - rollout).abs() * mask
    return {"mean": float(diff.sum() / mask.sum()), "max": float(diff.max())}


def _experts_used(model):
    """Per MoE layer, the ids its experts were called with (pre-hooks; remove the handles)."""
    used: list = []
    blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    handles = [
        block.experts.register_forward_pre_hook(lambda m, args: used.append(args[1].clone()))
        for block in blocks
    ]
    return used, handles


def scenario_replay(
    rank: int,
    world_size: int,
    out_dir: str,
    trainer: str = "fsdp2_train",
    infer_dtype: str = "fp32",
):
    """``trainer`` in fp32 and hf_infer in ``infer_dtype``: the log-prob gap without and with
    replay; with an fp32 rollout also the update's replay and old_policy."""
    import attrs
    import torch

    from posttrain.backend import moe_routers, record_routing

    _, _, state_class = _trainer(trainer)
    train, infer = _runtimes(rank, world_size, trainer, "fp32", infer_dtype)
    ctx = train.ctx
    # A first step on the rollout's routing moves the weights away from the preset's; the sync
    # gives them to the rollout engine.
    train.train_step(_rollout(infer, seed=1))
    train.export_begin(bucket_bytes=1 << 20)
    buckets = []
    while (bucket := train.export_next()) is not None:
        buckets.append(bucket)
    infer.import_weights(buckets)

    batch = _rollout(infer, seed=2)
    mask = batch.response_mask
    out: dict = {"routing_dtype": str(batch["routing"].dtype)}
    ctx.algorithm = attrs.evolve(ctx.algorithm, routing_replay="off")
    out["gap_off"] = _gap(train.compute_logprobs(batch), batch["rollout_logprobs"], mask)
    with torch.no_grad(), record_routing(ctx.model) as record:
        ctx.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    own = record.take().view(*batch.input_ids.shape, *batch["routing"].shape[2:])
    # The last token's routing is not the rollout's (never fed back): compare the others.
    out["own_agreement"] = float(
        (own[:, :-1].sort(-1).values == batch["routing"][:, :-1].long().sort(-1).values)
        .all(-1)
        .float()
        .mean()
    )

    ctx.algorithm = attrs.evolve(ctx.algorithm, routing_replay="rollout")
    used, handles = _experts_used(ctx.model)
    logprobs = train.compute_logprobs(batch)
    for handle in handles:
        handle.remove()
    out["gap_rollout"] = _gap(logprobs, batch["rollout_logprobs"], mask)
    flat = batch["routing"].reshape(-1, *batch["routing"].shape[2:]).long()
    out["trainer_used_recorded"] = len(used) == flat.shape[1] and all(
        torch.equal(ids, flat[:, layer]) for layer, ids in enumerate(used)
    )
    if infer_dtype != "fp32":
        torch.save(out, os.path.join(out_dir, f"replay_{trainer}_{infer_dtype}.pt"))
        return
    # Other ids replayed change the log-probs: the trainer's forward takes them.
    shifted = (batch["routing"].long() + 1) % EXPERTS
    other = train.compute_logprobs(batch.with_tensors(routing=shifted.to(torch.uint8)))
    out["gap_shifted"] = _gap(other, batch["rollout_logprobs"], mask)

    # The update replays too (gradient checkpointing recomputes the layers in backward).
    routers = [router.weight.detach().clone() for router in moe_routers(ctx.model)]
    out["update_rollout"] = train.train_step(batch)
    after = [router.weight for router in moe_routers(ctx.model)]
    out["routers_moved"] = all(not torch.equal(a, b) for a, b in zip(after, routers))

    # old_policy: the trainer's old-policy pass records, the update replays it.
    ctx.algorithm = attrs.evolve(ctx.algorithm, routing_replay="old_policy")
    plain = batch.with_tensors()
    del plain.tensors["routing"]
    old = train.compute_logprobs(plain)
    recorded = ctx.engine_state(state_class).old_routing
    out["old_policy_rows"] = len(recorded.rows)
    attached = recorded.attach(plain, "cpu")["routing"]
    with torch.no_grad(), record_routing(ctx.model) as record:
        ctx.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    own = record.take().view(*batch.input_ids.shape, *batch["routing"].shape[2:])
    out["old_policy_attached_own"] = bool(torch.equal(attached.long(), own))
    out["update_old_policy"] = train.train_step(plain.with_tensors(old_logprobs=old))

    # The update's consistency figures, against the trainer's own routing at these weights
    # and other ids replayed: every token but each row's last (the rollout never routed it).
    ctx.algorithm = attrs.evolve(ctx.algorithm, routing_replay="rollout")
    with torch.no_grad(), record_routing(ctx.model) as record:
        ctx.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    own = record.take().view(*batch.input_ids.shape, *batch["routing"].shape[2:])[:, :-1]
    replayed = shifted[:, :-1]
    out["shifted_agreement"] = float(
        (own.sort(-1).values == replayed.sort(-1).values).all(-1).float().mean()
    )
    loads = [
        torch.bincount(replayed[:, :, layer].reshape(-1), minlength=EXPERTS).float()
        for layer in range(replayed.shape[2])
    ]
    out["shifted_load_max"] = max(float(load.max() / load.mean()) for load in loads)
    out["update_shifted"] = train.train_step(batch.with_tensors(routing=shifted.to(torch.uint8)))
    if rank == 0:
        torch.save(out, os.path.join(out_dir, f"replay_{trainer}_{infer_dtype}.pt"))


def scenario_pool(rank: int, world_size: int, out_dir: str):
    """old_policy's routing when the update gives a rank rows another rank scored: each rank
    recorded its own half, the update's share mixes both; the ranks pool theirs."""
    import torch
    import torch.distributed as dist

    from posttrain.backend import OldPolicyRouting, init_default_process_group
    from posttrain.protocol import build_sequence_batch

    init_default_process_group("cpu")
    prompts = [[1, 2 + i] for i in range(4)]
    responses = [[3] * (i + 1) for i in range(4)]
    routing = [
        torch.full((len(p) + len(r), 2, 2), i, dtype=torch.uint8)
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    batch = build_sequence_batch(prompts, responses, 0, routing=routing)
    recorded = OldPolicyRouting()
    mine = batch.split(world_size)[rank]  # the old-policy pass's share
    for ids, rows in zip(mine.sequences(), mine["routing"]):
        recorded.rows[torch.tensor(ids).numpy().tobytes()] = rows[: len(ids)]
    # The update's share: one row of each rank's.
    share = batch.select([rank, rank + 2])
    attached = recorded.attach(share.with_tensors(), "cpu")
    ok = torch.equal(attached["routing"], share["routing"])
    found = [None] * world_size
    dist.all_gather_object(found, ok)
    if rank == 0:
        torch.save(found, os.path.join(out_dir, "pool.pt"))
