"""Rank functions of the megatron LoRA tests (spawned processes import them from here)."""

from __future__ import annotations

import os

from megatron_workers import DEVICE, engine_state, held_bytes, hook_relay, train_one

LORA = {"rank": 4, "alpha": 8.0, "sync": "adapter"}


def lora_runtime(rank, world_size, model_path, lora=None, dtype="fp32", **layout):
    from posttrain.config.sections import AlgorithmConfig, LoraArgs, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain_megatron.config import MegatronTrainConfig

    ctx = WorkerContext(
        role="actor_train",
        strategy_name="megatron_train",
        config=MegatronTrainConfig(**layout),
        model_args=ModelArgs(
            model_name_or_path=model_path, dtype=dtype, lora=LoraArgs(**(lora or LORA))
        ),
        training_args=TrainingArgs(
            learning_rate=1e-2,
            weight_decay=0.01,
            max_grad_norm=1.0,
            # As megatron_workers.make_runtime: layouts compared on their arithmetic, not on
            # Adam's sign of noise in near-zero gradients.
            adam_epsilon=1e-4,
            lr_scheduler_type="constant",
            max_steps=10,
            per_device_train_batch_size=2,
        ),
        rank=rank,
        world_size=world_size,
        algorithm=AlgorithmConfig(entropy_coef=1e-3),
        hook=hook_relay(),
        device=DEVICE,
    )
    runtime = WorkerRuntime(ctx)
    runtime.setup()
    return runtime


def _local(runtime, adapters: bool) -> dict:
    """This rank's parameters (its TP shards): the adapters', or the base's."""
    from posttrain_megatron.wrappers import unwrap

    return {
        name: p.detach().clone()
        for name, p in unwrap(runtime.ctx.model[0]).named_parameters()
        if (".adapter." in name) == adapters
    }


def _logits(runtime, ids):
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = runtime.ctx.model[0](
            input_ids=ids.to(DEVICE), position_ids=positions.to(DEVICE), attention_mask=None
        )
    full = gather_from_tensor_model_parallel_region(logits)
    return full[..., : engine_state(runtime.ctx).vocab_size].cpu()


def scenario_lora(rank, world_size, out_dir, model):
    """TP2 LoRA: two steps with a checkpoint after the first, a fresh trainer resumed from it
    for the second, the peft and merged exports and an adapter-only sync's buckets."""
    import torch

    from posttrain_megatron.weights import export_weights
    from posttrain_megatron.wrappers import inner_optimizers

    tp = {"tensor_model_parallel_size": 2}
    rt = lora_runtime(rank, world_size, model, **tp)
    base0, adapters0 = _local(rt, False), _local(rt, True)
    train_one(rt, 0)
    held = held_bytes(rt)
    ckpt = os.path.join(out_dir, "ckpt")
    # As the driver saves: asked for a background save, the adapters are written at once.
    begun = rt.begin_checkpoint(ckpt, True)
    base1, adapters1 = _local(rt, False), _local(rt, True)
    optimized = [
        p
        for inner in inner_optimizers(engine_state(rt.ctx).optimizer)
        for g in inner.param_groups
        for p in g["params"]
    ]
    train_one(rt, 1)
    adapters2 = _local(rt, True)

    resumed = lora_runtime(rank, world_size, model, **tp)
    resumed.load_checkpoint(ckpt)
    loaded = _local(resumed, True)
    train_one(resumed, 1)

    ids = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = _logits(rt, ids)
    rt.export_hf(os.path.join(out_dir, "peft"))
    rt.export_hf(os.path.join(out_dir, "merged"), merge=True)
    synced = {
        name: t.clone() for bucket in export_weights(rt.ctx, 1 << 20) for name, t in bucket.tensors
    }
    torch.save(
        {
            "base_unchanged": all(torch.equal(base0[k], base1[k]) for k in base0),
            "base_frozen": all(
                not p.requires_grad
                for n, p in rt.ctx.model[0].named_parameters()
                if ".adapter." not in n
            ),
            "optimized": len(optimized),
            "adapter_count": len(adapters0),
            "b_changed": all(
                not torch.equal(adapters0[k], adapters1[k]) for k in adapters0 if "lora_B" in k
            ),
            "loaded_equal": all(torch.equal(loaded[k], adapters1[k]) for k in loaded),
            "resumed_equal": all(
                torch.equal(v, _local(resumed, True)[k]) for k, v in adapters2.items()
            ),
            "adapters": adapters2,
            "held": held,
            "background": begun["background"],
            "ids": ids,
            "logits": logits,
            "synced": synced,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def scenario_lora_resume(rank, world_size, out_dir, model, tag, layout):
    """The TP2 checkpoint of :func:`scenario_lora` resumed under ``layout`` for its second
    step; the adapters exported in peft's format to ``peft_<tag>``."""
    rt = lora_runtime(rank, world_size, model, **layout)
    rt.load_checkpoint(os.path.join(out_dir, "ckpt"))
    train_one(rt, 1)
    rt.export_hf(os.path.join(out_dir, f"peft_{tag}"))
