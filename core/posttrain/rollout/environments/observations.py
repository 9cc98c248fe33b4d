"""Observations as the tokens the model reads after its turn.

The model's own tokens are never encoded again from text: an observation's tokens are appended
to the context as they are. With a chat template, a message observation is the template's text
between the model's turn and its next one: the end of the assistant turn, the tool (or user)
message and the next generation prompt. It is found by rendering a conversation whose assistant
turn is a marker and taking what follows the marker (the way verl's agent loop and slime cut
tool messages out of a rendered conversation), so any template that can render the role works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.errors import UserError
from posttrain.rollout.environments.protocol import ObservationRole

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_MARKER = "POSTTRAIN-MODEL-TURN"


def message_delta(tokenizer: PreTrainedTokenizerBase, content: str, role: str) -> str:
    """What the chat template writes after a model turn when a ``role`` message with
    ``content`` follows and the model is prompted again."""
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _MARKER},
        {"role": role, "content": content},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template's own error (jinja) for a role it does not know
        raise UserError(
            f"the tokenizer's chat template cannot render a '{role}' message after an assistant "
            f"turn ({type(exc).__name__}: {exc}); have the environment answer as 'user' or as "
            "text that continues the turn (role None)"
        ) from None
    return text[text.index(_MARKER) + len(_MARKER) :]


class ObservationEncoder:
    """``encode(observation, role, turn_ids)``: the token ids appended after a model turn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.special = set(tokenizer.all_special_ids)

    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(
        self, observation: str | list[int], role: ObservationRole, turn_ids: tuple[int, ...]
    ) -> list[int]:
        if isinstance(observation, list):
            return list(observation)
        if role is None or not self.templated:
            return self.text_ids(observation)
        ids = self.text_ids(message_delta(self.tokenizer, observation, role))
        # A turn the model closed itself ends with the template's end-of-turn token, which the
        # delta opens with: the model's token stays, the template's is dropped.
        if turn_ids and ids and ids[0] == turn_ids[-1] and ids[0] in self.special:
            ids = ids[1:]
        return ids
