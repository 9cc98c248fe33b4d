"""What an environment is: how it is declared, what it is given and what it answers.

An episode is a conversation between the policy and one environment. The environment reads the
prompt (``reset``), then each model turn (``step``), and answers with an observation that the
model reads before its next turn, a reward and whether the episode is over. Observations are
never trained on: their tokens carry loss mask 0.

Environments are plain Python objects built once per episode by the factory of
the :class:`EnvironmentSpec` a plugin declares through ``posttrain_add_environments``, in the
driver's threads or in worker processes (``environment.isolation``). Each call runs under
``environment.step_timeout_s``; one that raises, hangs or answers something that is not an
:class:`EnvStep` ends its episode with reward 0 (the run goes on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import attrs

# How an observation is shown to the model: as a message through the tokenizer's chat template
# ("tool" or "user"; plain text when the tokenizer has no template), or as text that continues
# the model's own turn (None: compact tool results, games that echo a board).
ObservationRole = Literal["tool", "user"] | None


@attrs.frozen(kw_only=True)
class EpisodePrompt:
    """What an environment is told when its episode starts."""

    # Names the episode in logs: "step 3 prompt 5 sample 2".
    episode_id: str
    text: str
    answer: str
    ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ModelTurn:
    """One turn of the model: the tokens it sampled and their text (special tokens skipped)."""

    text: str
    ids: tuple[int, ...]
    index: int  # 0 for the first turn
    # No turn follows, whatever the answer (turn limit or token budget reached): the reward of
    # this step is the episode's last.
    last: bool = False


@attrs.frozen(kw_only=True)
class EnvStep:
    """An environment's answer to one model turn."""

    # Shown to the model before its next turn (ignored once done): text, encoded as ``role``
    # says, or token ids appended as they are.
    observation: str | list[int] = ""
    reward: float = 0.0
    done: bool = False
    # Text the workflow's reward.function scores against the prompt's answer, added to
    # ``reward``: a tool environment hands its final answer over this way.
    answer: str | None = None
    # Valid tool calls the turn made (for env/tool_calls_mean and env/tool_call_rate).
    tool_calls: int = 0
    role: ObservationRole = "tool"


class Environment(Protocol):
    """One episode's environment. Calls come from one thread at a time, in order."""

    def reset(self, prompt: EpisodePrompt) -> str | list[int] | None:
        """Start the episode. A returned observation is appended to the prompt as it is (text
        encoded without a chat template) before the model's first turn; None adds nothing."""

    def step(self, turn: ModelTurn) -> EnvStep:
        """Answer one model turn."""


@attrs.frozen(kw_only=True)
class EnvironmentSpec:
    """An environment as declared through ``posttrain_add_environments``, by name.

    ``factory(config)`` builds the environment of one episode; ``config`` is the workflow's
    ``environment.kwargs`` structured into ``config_class`` (so unknown keys and bad values are
    reported by ``posttrain validate``, each with its YAML path), or the plain mapping when the
    spec has no config class. A ``"module:attr"`` factory is imported only when a run needs it.
    """

    factory: Callable[[Any], Environment] | str
    # An attrs class (frozen=True, kw_only=True) for environment.kwargs; None: a plain dict.
    config_class: type | None = None
    # Strings that end a model turn (vLLM's ``stop``), e.g. the closing tag of a tool call:
    # fixed, or computed from the structured config. They are added to the rollout role's
    # generating_args.stop_strings, so engines that set up stop strings at start see them too.
    stop_strings: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    # The tools the model may call, as chat templates take them (OpenAI function schemas:
    # ``{"type": "function", "function": {"name", "description", "parameters"}}``): fixed, or
    # computed from the structured config. Prompts are rendered with ``tools=`` these, so a
    # template that lists tools (Qwen2.5, Llama-3.1) announces them; empty: no tool list.
    tools: tuple[dict[str, Any], ...] | Callable[[Any], Sequence[dict[str, Any]]] = ()
    description: str = ""

    def stops(self, config: Any) -> tuple[str, ...]:
        """The stop strings for one structured ``config``."""
        return self.stop_strings(config) if callable(self.stop_strings) else self.stop_strings

    def tool_schemas(self, config: Any) -> list[dict[str, Any]]:
        """The tools' schemas for one structured ``config``."""
        return list(self.tools(config) if callable(self.tools) else self.tools)
