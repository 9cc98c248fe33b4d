"""The ``deepspeed_train`` and ``deepspeed_infer`` strategies: HF models in DeepSpeed ZeRO engines.

This module is cheap to import (no torch, no deepspeed): ``posttrain validate``, ``plugins`` and
``doctor`` load it. The worker hooks (from :class:`posttrain.EngineHooks`) import
:mod:`posttrain_deepspeed.engine` when a rank of one of these strategies first needs it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from posttrain import Capabilities, EngineHooks, EnvCheck, ErrorReport, StrategySpec, hookimpl
from posttrain_deepspeed.config import DeepSpeedInferConfig, DeepSpeedTrainConfig

if TYPE_CHECKING:
    from posttrain import TrainEngine, Workflow
    from posttrain.backend import MemoryQuery, RoleMemory
    from posttrain_deepspeed import engine

    _ENGINE: TrainEngine = engine  # mypy: the engine defines every function it must, typed

TRAIN = "deepspeed_train"
INFER = "deepspeed_infer"
STRATEGIES = (TRAIN, INFER)
# The DeepSpeed releases this plugin is tested with (0.19.8 on CPU over gloo).
TESTED = ">=0.16,<0.20"


class DeepSpeedPlugin(EngineHooks):
    strategies = STRATEGIES
    engine = "posttrain_deepspeed.engine"
    preload = ("deepspeed", "posttrain_deepspeed.engine")  # deepspeed: about 4 s of a CI core

    @hookimpl
    def posttrain_add_strategies(self) -> list[StrategySpec]:
        return [
            StrategySpec(
                name=TRAIN,
                config_class=DeepSpeedTrainConfig,
                capabilities=Capabilities(
                    kind="train",
                    exports_hf_weights=True,
                    computes_logprobs=True,
                    shares_process=True,
                    lora=True,
                    routing_replay=True,
                ),
                description="training with DeepSpeed ZeRO-1/2/3 (optional CPU offload), "
                "DeepSpeed checkpoints",
            ),
            StrategySpec(
                name=INFER,
                config_class=DeepSpeedInferConfig,
                capabilities=Capabilities(
                    kind="infer", computes_logprobs=True, shares_process=True
                ),
                description="log-probs (reference / old policy) with a DeepSpeed ZeRO-3 model",
            ),
        ]

    @hookimpl
    def posttrain_validate_workflow(
        self, workflow: Workflow, strategies: dict[str, StrategySpec], report: ErrorReport
    ) -> None:
        from posttrain.backend import routing_replay_problem
        from posttrain_deepspeed.checks import check_role

        for name, role in workflow.roles().items():
            config = role.strategy_args.strategy_config
            if role.strategy_args.strategy_name not in STRATEGIES or isinstance(config, dict):
                continue
            check_role(name, config, report)
            if name == "actor_train" and "algorithm" not in report.failed_sections:
                # routing_replay on a model without experts (config.json, no torch).
                problem = routing_replay_problem(workflow)
                if problem is not None:
                    report.error(*problem)

    @hookimpl
    def posttrain_environment_checks(self) -> list[EnvCheck]:
        return [EnvCheck(plugin="posttrain-deepspeed", package="deepspeed", tested=TESTED)]

    @hookimpl
    def posttrain_estimate_memory(self, query: MemoryQuery) -> RoleMemory | None:
        from posttrain_deepspeed import memory

        name = query.role.strategy_args.strategy_name
        if name == TRAIN:
            return memory.estimate_train(query)
        if name == INFER:
            return memory.estimate_infer(query)
        return None


def _not_the_cpu_guess(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU")


# Not this plugin's import: accelerate imports deepspeed wherever it is installed (transformers'
# save_pretrained unwraps every model through it), so runs of any strategy import it, and on a
# machine without CUDA its first import guesses the CPU accelerator with a warning, in the
# driver's console (a preset's build) and the ranks' logs. This plugin's engine names its
# accelerator (DS_ACCELERATOR) and never guesses; for the others the guess is harmless. The
# filter holds on DeepSpeed's logger, which DeepSpeed configures but does not replace.
logging.getLogger("DeepSpeed").addFilter(_not_the_cpu_guess)

plugin = DeepSpeedPlugin()
