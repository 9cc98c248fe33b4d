"""What an environment may answer: anything else is garbage and ends its episode with 0."""

from __future__ import annotations

import math
from typing import Any

from posttrain.rollout.environments.protocol import EnvStep

ROLES = ("tool", "user", None)


def observation_problem(observation: Any, vocab_size: int) -> str | None:
    """Why ``observation`` is not text or a list of token ids of the vocabulary; None if it is."""
    if isinstance(observation, str):
        return None
    if not isinstance(observation, list):
        return f"the observation is a {type(observation).__name__}, not text or token ids"
    for token in observation:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return f"the observation holds {token!r}, not a token id below {vocab_size}"
    return None


def step_problem(step: Any, vocab_size: int) -> str | None:
    """Why ``step`` is not a well-formed :class:`EnvStep`; None if it is."""
    if not isinstance(step, EnvStep):
        return f"a {type(step).__name__}, not an EnvStep"
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return f"the reward {reward!r} is not a finite number"
    if not isinstance(step.done, bool):
        return f"done is {step.done!r}, not true or false"
    if step.answer is not None and not isinstance(step.answer, str):
        return f"the answer is a {type(step.answer).__name__}, not text"
    calls = step.tool_calls
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        return f"tool_calls is {calls!r}, not a count"
    if step.role not in ROLES:
        return f"the role {step.role!r} is none of tool, user, None"
    return None if step.done else observation_problem(step.observation, vocab_size)
