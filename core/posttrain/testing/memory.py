"""What a backend's memory estimate (``posttrain_estimate_memory``) says for a role, for tests
that hold it against what a rank really holds after a step."""

from __future__ import annotations

from typing import Any

from posttrain.config.sections import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from posttrain.memory.estimate import MemoryQuery, RoleMemory, Workload
from posttrain.memory.geometry import read_geometry


def role_estimate(
    plugin: Any,
    strategy_name: str,
    config: Any,
    *,
    model: str,
    ranks: int,
    rows: int,
    prompt_tokens: int,
    response_tokens: int,
    model_args: dict[str, Any] | None = None,
    training_args: dict[str, Any] | None = None,
    role_name: str = "actor_train",
) -> RoleMemory:
    """``plugin``'s estimate of one rank of ``role_name`` running ``strategy_name`` with the
    structured ``config`` on ``ranks`` CPU ranks, for a step of ``rows`` sequences of
    ``prompt_tokens`` + ``response_tokens`` of ``model`` (a directory or a preset).
    ``model_args`` and ``training_args`` are the role's fields beyond the model's name (a
    trainer gets default ``training_args``)."""
    role = RoleConfig(
        strategy_args=StrategyArgs(strategy_name=strategy_name, strategy_config=config),
        device_mapping=tuple(range(ranks)),
        model_args=ModelArgs(model_name_or_path=model, **(model_args or {})),
        training_args=TrainingArgs(**(training_args or {})),
    )
    geometry = read_geometry(model)
    if geometry is None:
        raise ValueError(f"no geometry for {model!r}: neither a model directory nor a preset")
    query = MemoryQuery(
        role_name=role_name,
        role=role,
        config=config,
        geometry=geometry,
        workload=Workload(
            rows=rows,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            bucket_bytes=0,
        ),
        device="cpu",
    )
    estimate = plugin.posttrain_estimate_memory(query=query)
    if estimate is None:
        raise ValueError(f"{plugin!r} gives no estimate for {strategy_name}")
    return estimate
