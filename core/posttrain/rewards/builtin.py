"""Built-in reward functions, declared by name."""

from posttrain.markers import hookimpl


@hookimpl(trylast=True)
def posttrain_add_reward_functions():
    return {
        "exact_match": "posttrain.rewards.functions:exact_match",
        "numeric_match": "posttrain.rewards.functions:numeric_match",
    }
