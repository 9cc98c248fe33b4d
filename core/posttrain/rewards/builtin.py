"""Built-in reward functions, declared by name, and the check of ``reward.function``."""

from posttrain.markers import hookimpl
from posttrain.rewards.functions import check_reward_function


@hookimpl(trylast=True)
def posttrain_add_reward_functions():
    return {
        "exact_match": "posttrain.rewards.functions:exact_match",
        "numeric_match": "posttrain.rewards.functions:numeric_match",
    }


@hookimpl(trylast=True)
def posttrain_validate_workflow(workflow, report, hook) -> None:
    if "reward" not in report.failed_sections:
        check_reward_function(workflow.reward.function, hook, report)
