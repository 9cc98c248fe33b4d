"""Roles started by hand for a benchmark (no workflow, no loop), and a random batch to train one
on. The launcher and the role's config are core internals: benchmarks are not plugins."""

from __future__ import annotations

from posttrain import GeneratingArgs, ModelArgs, TrainingArgs
from posttrain.config.converter import CONVERTER
from posttrain.config.sections import AlgorithmConfig, LoraArgs, RoleConfig, StrategyArgs
from posttrain.host.plugin_host import create_plugin_host
from posttrain.launch.base import GroupSpec


def role_spec(
    role: str,
    strategy: str,
    model_dir: str,
    run_dir: str,
    *,
    raw: dict | None = None,
    devices: tuple[int, ...] = (0,),
    ranks: int | None = None,
    model_dtype: str = "fp32",
    device: str = "cpu",
    checkpointing: bool = False,
    learning_rate: float = 1e-5,
    seed: int = 0,
    threads: int | None = None,
    lora: LoraArgs | None = None,
) -> GroupSpec:
    """``role`` running ``strategy`` with ``strategy_config`` ``raw`` on ``devices`` (``ranks``
    ranks, default one per device), default generating settings."""
    spec = create_plugin_host().strategies()[strategy]
    config = RoleConfig(
        strategy_args=StrategyArgs(
            strategy_name=strategy,
            strategy_config=CONVERTER.structure(raw or {}, spec.config_class),
        ),
        device_mapping=devices,
        world_size=ranks,
        model_args=ModelArgs(
            model_name_or_path=model_dir,
            dtype=model_dtype,
            disable_gradient_checkpointing=not checkpointing,
            lora=lora,
        ),
        training_args=TrainingArgs(learning_rate=learning_rate),
        generating_args=GeneratingArgs(),
    )
    return GroupSpec(
        role=role,
        config=config,
        algorithm=AlgorithmConfig(),
        seed=seed,
        run_dir=run_dir,
        base_dir=run_dir,
        device=device,
        threads=threads,
    )


def trainer_group(
    launcher, strategy: str, raw: dict, model_dir: str, run_dir: str, *, ranks: int = 1, **settings
):
    """``actor_train`` running ``strategy`` on ``ranks`` local ranks; ``settings``: the other
    keywords of :func:`role_spec`."""
    spec = role_spec(
        "actor_train",
        strategy,
        model_dir,
        run_dir,
        raw=raw,
        devices=tuple(range(ranks)),
        **settings,
    )
    return launcher.start_group(spec)


def random_train_batch(rows: int, seq: int, dp_size: int):
    """``rows`` sequences of ``seq`` random tokens (16 of prompt), with old log-probs and
    advantages, normalised for one step over ``dp_size`` ranks."""
    import torch

    from posttrain.protocol import build_sequence_batch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (16,), generator=gen).tolist()] * rows
    responses = [torch.randint(10, 1000, (seq - 16,), generator=gen).tolist() for _ in range(rows)]
    batch = build_sequence_batch(prompts, responses, 0)
    batch = batch.with_tensors(
        old_logprobs=torch.full_like(batch.response_mask, -7.0),
        advantages=torch.randn(rows, generator=gen)[:, None] * batch.response_mask,
    )
    batch.meta.update(
        global_tokens=float(batch.response_mask.sum()), global_seqs=float(rows), dp_size=dp_size
    )
    return batch
