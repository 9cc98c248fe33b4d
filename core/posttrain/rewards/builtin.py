"""Built-in reward functions, declared by name, and the check of ``reward.function``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.markers import hookimpl
from posttrain.rewards.functions import check_reward_function

if TYPE_CHECKING:
    import pluggy

    from posttrain.config.report import ErrorReport
    from posttrain.config.sections import Workflow


@hookimpl(trylast=True)
def posttrain_add_reward_functions() -> dict[str, str]:
    return {
        "exact_match": "posttrain.rewards.functions:exact_match",
        "numeric_match": "posttrain.rewards.functions:numeric_match",
    }


@hookimpl(trylast=True)
def posttrain_validate_workflow(
    workflow: Workflow, report: ErrorReport, hook: pluggy.HookRelay
) -> None:
    if "reward" not in report.failed_sections:
        check_reward_function(workflow.reward.function, hook, report)
