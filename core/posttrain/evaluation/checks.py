"""The ``evaluation:`` section's cross-field checks, with the workflow's others (before any
process starts)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from posttrain.config.data_sections import check_prompt_source
from posttrain.config.report import ErrorReport, join_path
from posttrain.config.sections import Workflow
from posttrain.markers import hookimpl
from posttrain.rewards.functions import check_reward_function

if TYPE_CHECKING:
    import pluggy

# A dataset's name is part of its metrics' names (val/<name>/...): a path segment of its own.
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def check_evaluation(workflow: Workflow, hook: pluggy.HookRelay, report: ErrorReport) -> None:
    cfg = workflow.evaluation
    scheduled = cfg.every_steps or cfg.before_training
    if scheduled and not cfg.datasets:
        report.error(
            "evaluation.datasets",
            "no held-out dataset, but evaluation.every_steps or before_training asks for "
            "evaluations",
            "add a dataset, e.g. datasets: [{name: heldout, synthetic: {task: "
            "single_digit_addition, split: held_out}}]",
        )
    if cfg.n > 1 and cfg.temperature == 0:
        report.error(
            "evaluation.n",
            f"{cfg.n} samples per prompt with greedy decoding (temperature 0) would all be the "
            "same",
            "set evaluation.temperature above 0 (e.g. 1.0) to sample, or n: 1 for greedy",
        )
    if cfg.datasets and workflow.environment.name:
        report.note(
            "evaluation",
            f"held-out prompts are sampled in single turns, without environment "
            f"'{workflow.environment.name}' (multi-turn evaluation is not supported yet)",
        )
    scored = workflow.reward.function or workflow.reward.strategy_args is not None
    seen: set[str] = set()
    for index, dataset in enumerate(cfg.datasets):
        where = join_path("evaluation.datasets", index)
        if not NAME.fullmatch(dataset.name):
            report.error(
                f"{where}.name",
                f"{dataset.name!r} cannot name metrics (val/<name>/...)",
                "use letters, digits, '_', '-' or '.'",
            )
        elif dataset.name in seen:
            report.error(f"{where}.name", f"'{dataset.name}' names two datasets", "rename one")
        seen.add(dataset.name)
        check_prompt_source(dataset, workflow.base_dir, where, report)
        if dataset.reward is not None:
            check_reward_function(dataset.reward.function, hook, report, f"{where}.reward.function")
        elif not scored:
            report.error(
                f"{where}.reward",
                "no reward: the train reward has no function and no reward model (the "
                "environment's rewards do not score single turns)",
                f"set {where}.reward: {{function: exact_match}}",
            )


@hookimpl(trylast=True)
def posttrain_validate_workflow(
    workflow: Workflow, report: ErrorReport, hook: pluggy.HookRelay
) -> None:
    if "evaluation" not in report.failed_sections:
        check_evaluation(workflow, hook, report)
