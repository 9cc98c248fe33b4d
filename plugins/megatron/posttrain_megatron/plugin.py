"""``megatron_train`` and ``megatron_infer``: megatron-core models, HF weights through mbridge.

This module is cheap to import (no torch, no megatron-core): ``posttrain validate``, ``plugins``
and ``doctor`` load it. The worker hooks (from :class:`posttrain.EngineHooks`) import
:mod:`posttrain_megatron.engine` when a rank of one of these strategies first needs it. The
``posttrain convert`` subcommand is added here too (core knows nothing of it).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

from posttrain import Capabilities, EngineHooks, EnvCheck, ErrorReport, StrategySpec, hookimpl
from posttrain_megatron.config import MegatronInferConfig, MegatronTrainConfig

if TYPE_CHECKING:
    import argparse

    from posttrain import TrainEngine, Workflow
    from posttrain.backend import MemoryQuery, RoleMemory
    from posttrain_megatron import engine

    _ENGINE: TrainEngine = engine  # mypy: the engine defines every function it must, typed

TRAIN = "megatron_train"
INFER = "megatron_infer"
STRATEGIES = (TRAIN, INFER)
# Versions this plugin is tested with (0.16.x on Python 3.11, 0.19.x on the GPU machine's 3.12).
# TransformerEngine and apex are used when installed and never required.
TESTED = {
    "megatron-core": (">=0.16.1,<0.20", True),
    "mbridge": (">=0.15.1,<0.16", True),
    "transformer-engine": (">=2.0", False),
    "apex": (">=0.1", False),
}
_PARALLEL_DIMS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
)
# What initialize_model_parallel sets for the whole process.
LAYOUT_FIELDS = (
    *_PARALLEL_DIMS,
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


# A role's process-wide parallel layout: its LAYOUT_FIELDS' values.
Layout = tuple[object, ...]


def _layout(strategy_name: str, cfg: object) -> Layout | None:
    """The parallel layout a megatron role (its strategy and strategy config) sets
    process-wide (None for other strategies)."""
    if strategy_name not in STRATEGIES:
        return None
    return tuple(getattr(cfg, name, None) for name in LAYOUT_FIELDS)


def split_by_layout(
    members: tuple[str, ...], layout_of: Callable[[str], Layout | None]
) -> list[tuple[str, ...]]:
    """Split one set of roles so that no two megatron layouts differ inside a set."""
    parts: list[list[str]] = []
    for name in members:
        mine = layout_of(name)
        home = next(
            (
                part
                for part in parts
                if mine is None or all(layout_of(m) in (None, mine) for m in part)
            ),
            None,
        )
        if home is None:
            parts.append([name])
        else:
            home.append(name)
    return [tuple(part) for part in parts]


class MegatronPlugin(EngineHooks):
    strategies = STRATEGIES
    engine = "posttrain_megatron.engine"
    # megatron-core and mbridge take about 10 s of a CI core to import: once in the fork server.
    preload = (
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.optimizer",
        "megatron.core.distributed",
        "megatron.core.pipeline_parallel",
        "megatron.core.tensor_parallel",
        "megatron.core.dist_checkpointing",
        "mbridge",
        "posttrain_megatron.engine",
    )

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=TRAIN,
                config_class=MegatronTrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    parallel_dims=_PARALLEL_DIMS,
                    exports_hf_weights=True,
                    computes_logprobs=True,
                    shares_process=True,
                    heads=("lm", "value"),
                    routing_replay=True,
                    # posttrain_megatron.lora: TP-sharded adapters on megatron's linears.
                    lora=True,
                ),
                description="training (actor or critic) with megatron-core (TP/PP/VPP/EP/SP, "
                "distributed optimizer, dist checkpoints), HF weights through mbridge",
            ),
            StrategySpec(
                name=INFER,
                config_class=MegatronInferConfig,
                capabilities=Capabilities(
                    kind="infer",
                    parallel_dims=_PARALLEL_DIMS,
                    computes_logprobs=True,
                    shares_process=True,
                    routing_replay=True,
                ),
                description="log-probs (reference / old policy) with a megatron-core model",
            ),
        ]

    @hookimpl(wrapper=True)
    def posttrain_plan_processes(
        self, workflow: Workflow, strategies: dict[str, StrategySpec]
    ) -> Generator[None, list[tuple[str, ...]], list[tuple[str, ...]]]:
        """megatron-core's parallel state is one per process: two megatron roles share rank
        processes only with the same layout (the second one reuses it)."""
        plan = yield
        args = {name: role.strategy_args for name, role in workflow.roles().items()}
        return [
            part
            for members in plan
            for part in split_by_layout(
                members, lambda name: _layout(args[name].strategy_name, args[name].strategy_config)
            )
        ]

    @hookimpl
    def posttrain_validate_workflow(
        self, workflow: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
    ) -> None:
        from posttrain_megatron.checks import check_lora, check_role, model_shape

        for name, role in workflow.roles().items():
            config = role.strategy_args.strategy_config
            if role.strategy_args.strategy_name not in STRATEGIES or isinstance(config, dict):
                continue
            shape = model_shape(role.model_args.model_name_or_path, workflow.base_dir)
            check_role(name, config, shape, report)
            lora = role.model_args.lora
            # Only the policy trains adapters (core refuses model_args.lora elsewhere).
            if name == "actor_train" and role.strategy_args.strategy_name == TRAIN and lora:
                check_lora(name, lora, config, report)
        # algorithm.routing_replay on for a megatron_train actor whose model has no experts.
        actor = workflow.roles().get("actor_train")
        if (
            actor is not None
            and actor.strategy_args.strategy_name == TRAIN
            and "algorithm" not in report.failed_sections
        ):
            from posttrain.backend import routing_replay_problem

            problem = routing_replay_problem(workflow)
            if problem is not None:
                report.error(*problem)

    @hookimpl
    def posttrain_environment_checks(self) -> list[EnvCheck]:
        return [
            EnvCheck(plugin="posttrain-megatron", package=package, tested=tested, required=required)
            for package, (tested, required) in TESTED.items()
        ]

    @hookimpl
    def posttrain_add_cli_commands(self, subparsers: argparse._SubParsersAction) -> None:
        from posttrain_megatron.convert_cli import add_convert_command

        add_convert_command(subparsers)

    @hookimpl
    def posttrain_estimate_memory(self, query: MemoryQuery) -> RoleMemory | None:
        from posttrain_megatron import memory

        name = query.role.strategy_args.strategy_name
        if name == TRAIN:
            return memory.estimate_train(query)
        if name == INFER:
            return memory.estimate_infer(query)
        return None


plugin = MegatronPlugin()
