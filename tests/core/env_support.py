"""Environments for the environment tests only: scripted turns, and ones that break on purpose.

Also a plugin module (``posttrain_add_environments``), so a host or a workflow's ``plugins:`` list
can declare them by name. The prompts' answers pick the breakage, so one batch of episodes holds
healthy and broken ones side by side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from posttrain import hookimpl
from posttrain.rollout.environments.protocol import EnvironmentSpec, EnvStep, ModelTurn

# What Broken does for a prompt whose answer is the key.
RAISES, HANGS, GARBAGE = "1", "2", "3"
# Hung calls wait on this instead of sleeping, so a test can let their threads go.
RELEASE_HUNG = threading.Event()
# What Hostile does in its second step, in a worker process (isolation: process), by answer.
SLEEPS, EXITS, SIGKILLED, SPAWNS_AND_HANGS = "4", "5", "6", "7"


def note_pid(config: dict, pid: int) -> None:
    """Leave ``pid`` in ``config["pid_dir"]`` (when set), for a test to check it is gone."""
    if config.get("pid_dir"):
        open(os.path.join(config["pid_dir"], str(pid)), "w").close()


class Countdown:
    """Answers every turn with ``observation`` and ``reward``; after ``turns`` turns it is done
    and hands over the prompt's answer (which reward.function then scores 1). ``turns: 0``:
    never done. ``reward: digits``: a turn's reward is the number of digits the model wrote in
    it, so that samples differ and a run learns something."""

    def __init__(self, config: dict):
        note_pid(config, os.getpid())
        self.config = config
        self.turns = config.get("turns", 3)
        self.observation = config.get("observation", "=5")
        self.reward = config.get("reward", 0.25)
        self.answer = ""

    def reset(self, prompt) -> str | None:
        self.answer = prompt.answer
        return None

    def step(self, turn: ModelTurn) -> EnvStep:
        reward = self.reward
        if reward == "digits":
            reward = float(sum(c.isdigit() for c in turn.text))
        if self.turns and turn.index + 1 == self.turns:
            return EnvStep(reward=reward, done=True, answer=self.answer)
        return EnvStep(observation=self.observation, reward=reward, tool_calls=1, role=None)


class Broken(Countdown):
    """A Countdown whose second step raises, hangs or answers garbage, by the prompt's answer."""

    def step(self, turn: ModelTurn) -> EnvStep:
        if turn.index == 1 and self.answer == RAISES:
            raise RuntimeError("the environment crashed")
        if turn.index == 1 and self.answer == HANGS:
            RELEASE_HUNG.wait(60)
        if turn.index == 1 and self.answer == GARBAGE:
            return EnvStep(reward=float("nan"))
        return super().step(turn)


class Hostile(Countdown):
    """A Countdown whose second step, in a worker process, hangs for good, exits the process,
    SIGKILLs it, or starts a child and hangs, by the prompt's answer (else raises as Broken)."""

    def step(self, turn: ModelTurn) -> EnvStep:
        if turn.index == 1 and self.answer == SLEEPS:
            time.sleep(3600)
        if turn.index == 1 and self.answer == EXITS:
            os._exit(3)
        if turn.index == 1 and self.answer == SIGKILLED:
            os.kill(os.getpid(), signal.SIGKILL)
        if turn.index == 1 and self.answer == SPAWNS_AND_HANGS:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            note_pid(self.config, child.pid)
            time.sleep(3600)
        if turn.index == 1 and self.answer == RAISES:
            raise RuntimeError("the environment crashed")
        return super().step(turn)


class Unbuildable(Countdown):
    """Its constructor raises."""

    def __init__(self, config: dict):
        note_pid(config, os.getpid())
        raise ValueError("no such board size")


SPECS = {
    "countdown": EnvironmentSpec(factory=Countdown, description="scripted turns (tests)"),
    "broken": EnvironmentSpec(factory=Broken, description="breaks by answer (tests)"),
    "hostile": EnvironmentSpec(factory=Hostile, description="hangs or dies by answer (tests)"),
    "unbuildable": EnvironmentSpec(factory=Unbuildable, description="cannot be built (tests)"),
}


@hookimpl
def posttrain_add_environments():
    return SPECS
