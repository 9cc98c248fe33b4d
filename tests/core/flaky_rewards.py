"""Reward functions that misbehave on purpose, by the completion they get (spawned reward
workers import this module by name)."""

import signal
import time


def flaky(completion: str, answer: str, prompt: str = "", **_) -> float:
    if completion == "raise":
        raise RuntimeError("verifier crashed")
    if completion == "hang":
        time.sleep(60)
    if completion == "garbage":
        return "not a number"
    if completion == "nan":
        return float("nan")
    if completion == "deaf":
        # Ignores the timer (as code stuck in C would): only killing the pool stops it.
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    return 1.0 if completion == answer else 0.0
