"""One trainer role started by hand for a benchmark, and a random batch to train it on."""

from __future__ import annotations


def trainer_group(
    launcher,
    strategy: str,
    raw: dict,
    model_dir: str,
    run_dir: str,
    *,
    model_dtype: str,
    device: str,
    ranks: int = 1,
    checkpointing: bool = False,
    threads: int | None = None,
):
    """``actor_train`` on ``ranks`` local ranks running ``strategy`` with ``strategy_config``
    ``raw`` (learning rate 1e-5, seed 0)."""
    from posttrain.config.converter import CONVERTER
    from posttrain.config.sections import (
        AlgorithmConfig,
        ModelArgs,
        RoleConfig,
        StrategyArgs,
        TrainingArgs,
    )
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.launch.base import GroupSpec

    spec = create_plugin_host().strategies()[strategy]
    role = RoleConfig(
        strategy_args=StrategyArgs(
            strategy_name=strategy, strategy_config=CONVERTER.structure(raw, spec.config_class)
        ),
        device_mapping=tuple(range(ranks)),
        model_args=ModelArgs(
            model_name_or_path=model_dir,
            dtype=model_dtype,
            disable_gradient_checkpointing=not checkpointing,
        ),
        training_args=TrainingArgs(learning_rate=1e-5),
    )
    return launcher.start_group(
        GroupSpec(
            role="actor_train",
            config=role,
            algorithm=AlgorithmConfig(),
            seed=0,
            run_dir=run_dir,
            base_dir=model_dir,
            device=device,
            threads=threads,
        )
    )


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
