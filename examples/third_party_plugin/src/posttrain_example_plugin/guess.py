"""``guess_digit``: a multi-turn environment. The model answers with a digit; a wrong guess is
answered with ``+`` (the answer is higher) or ``-`` (lower) and the model guesses again, until it
is right or ``environment.max_turns`` runs out. Right at turn ``t`` (0-based) scores
``1 / (t + 1)``: fewer guesses, more reward."""

from __future__ import annotations

from typing import Any

from posttrain import EnvStep, EpisodePrompt, ModelTurn


class GuessDigit:
    def __init__(self, config: dict[str, Any]) -> None:
        # config: the workflow's environment.kwargs (a dict: this spec declares no config
        # class); "higher" / "lower" replace the hints.
        self.hints = (config.get("higher", "+"), config.get("lower", "-"))

    def reset(self, prompt: EpisodePrompt) -> str | None:
        self.answer = prompt.answer.strip()
        return None  # nothing to add to the prompt

    def step(self, turn: ModelTurn) -> EnvStep:
        guess = turn.text.strip()[:1]
        if guess == self.answer:
            return EnvStep(reward=1.0 / (turn.index + 1), done=True)
        if not guess.isdigit() or not self.answer.isdigit():
            return EnvStep(done=True)  # not a digit: the episode ends with reward 0
        # The hint continues the model's own text (role None): "3-" then the next guess.
        hint = self.hints[0] if int(self.answer) > int(guess) else self.hints[1]
        return EnvStep(observation=hint, role=None)
