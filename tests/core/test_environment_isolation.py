"""Environments in worker processes (``environment.isolation: process``) and what environment
failures leave behind: a hung or dying environment is killed within its timeout, its episode
scores 0, no process of it is left and the pool serves the next step; a raising constructor is
named as such; the console gets one line per step, RUN_DIR/logs every traceback; steps whose
every episode fails stop the run after ``environment.max_failed_steps``.

The model's turns come from a stand-in ``generate`` (one fixed token a turn): what is under test
is the runner and its processes, not the engine (tests/core/test_episode_runner.py has that)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from env_support import EXITS, RAISES, SIGKILLED, SLEEPS, SPAWNS_AND_HANGS, SPECS, Countdown

from posttrain.config.sections import EnvironmentConfig
from posttrain.errors import UserError
from posttrain.protocol import RolloutSamples, SamplingParams
from posttrain.rollout.environments.failures import Failure, FailureLog
from posttrain.rollout.environments.protocol import EnvironmentSpec
from posttrain.rollout.environments.runner import EpisodeRunner
from posttrain.tasks.data import Prompt
from posttrain.tasks.presets import build_tokenizer

SAMPLING = SamplingParams(max_new_tokens=2)
RUNNER_LOG = "posttrain.rollout.environments.runner"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class Turns:
    """``generate`` for the runner: the token of "7" each turn; notes when each turn began."""

    def __init__(self, tokenizer):
        self.ids = tokenizer("7", add_special_tokens=False)["input_ids"]
        self.started: list[float] = []

    def __call__(self, contexts, sampling, turn):
        self.started.append(time.monotonic())
        n = len(contexts)
        return RolloutSamples(
            prompt_ids=contexts,
            response_ids=[list(self.ids)] * n,
            response_logprobs=[[-0.5] * len(self.ids)] * n,
        )


def prompts(tokenizer, answers: list[str]) -> list[Prompt]:
    return [
        Prompt(text="1+1=", answer=a, ids=tuple(tokenizer("1+1=")["input_ids"])) for a in answers
    ]


def runner(tokenizer, name: str, log_dir=None, **settings) -> EpisodeRunner:
    config = EnvironmentConfig(name=name, **settings)
    return EpisodeRunner(SPECS[name], config, tokenizer, log_dir=log_dir)


def gone(pid: int) -> bool:
    """The process has exited (a zombie left to a parent that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still running after ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(map(gone, pids)):
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


@pytest.mark.timeout(120)
def test_hung_and_dying_environments_are_killed_and_the_pool_goes_on(tokenizer, tmp_path, caplog):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # One worker each for the first six (round robin over 6); the last two share the first
    # two's workers: the 8th's environment lives with the one that hangs.
    answers = ["0", SLEEPS, EXITS, SIGKILLED, SPAWNS_AND_HANGS, RAISES, "0", "0"]
    run = runner(
        tokenizer,
        "hostile",
        tmp_path / "logs",
        kwargs={"turns": 3, "pid_dir": str(pid_dir)},
        isolation="process",
        processes=6,
        step_timeout_s=1.0,
    )
    turns = Turns(tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger=RUNNER_LOG):
            out = run.run(prompts(tokenizer, answers), 1, turns, SAMPLING, "step 1")
        # The breaking step (the second) lasted its timeout, not the hour its calls would take.
        assert 1.0 <= turns.started[2] - turns.started[1] < 2.5
        assert out.rewards == [0.75, 0, 0, 0, 0, 0, 0.75, 0]
        assert out.metrics["env/timeouts"] == 2 and out.metrics["env/errors"] == 4
        # Every process of the first step's broken environments is gone: four workers, and the
        # child one of them started in a session of its own.
        first = [int(p) for p in os.listdir(pid_dir)]
        assert len(first) == 6 + 1
        alive = set(run.instances.pids())
        assert wait_gone([p for p in first if p not in alive]) == []
        assert len(alive) == 2  # the healthy ones' workers; the others come back when needed
        # One console line for the step, naming the count, the first failure and the log.
        lines = [r.getMessage() for r in caplog.records if r.name == RUNNER_LOG]
        assert len(lines) == 1, lines
        assert "step 1: 6 of 8 episodes failed and score 0 (4 errors, 2 timeouts)" in lines[0]
        assert "first: step 1 prompt 1 sample 0: turn 1: step() did not answer" in lines[0]
        assert "environments.log" in lines[0]
        text = (tmp_path / "logs" / "environments.log").read_text()
        for expected in (
            "step 1 prompt 2 sample 0: turn 1: step() could not answer: the worker process died "
            "(exit code 3)",
            "step 1 prompt 3 sample 0: turn 1: step() could not answer: the worker process died "
            "(killed by SIGKILL)",
            "step 1 prompt 4 sample 0: turn 1: step() did not answer within 1s",
            "step 1 prompt 5 sample 0: turn 1: step() raised RuntimeError: the environment crashed",
            'raise RuntimeError("the environment crashed")',  # the worker's traceback
            "step 1 prompt 7 sample 0: turn 1: step() could not answer: its environment was lost: "
            "its worker process was killed when step() of step 1 prompt 1 sample 0 overran",
        ):
            assert expected in text
        # The next step: the pool serves every episode, in fresh workers where needed.
        out = run.run(prompts(tokenizer, ["0"] * 8), 1, Turns(tokenizer), SAMPLING, "step 2")
        assert out.rewards == [0.75] * 8 and out.metrics["env/errors"] == 0
        workers = run.instances.pids()
        assert len(workers) == 6
    finally:
        run.close()
    assert wait_gone([int(p) for p in os.listdir(pid_dir)]) == []
    assert set(workers) <= {int(p) for p in os.listdir(pid_dir)}


def test_a_raising_constructor_is_named_and_failed_steps_stop_the_run(tokenizer, tmp_path, caplog):
    run = runner(tokenizer, "unbuildable", tmp_path / "logs", max_failed_steps=2)
    with caplog.at_level(logging.WARNING, logger=RUNNER_LOG):
        out = run.run(prompts(tokenizer, ["0", "1"]), 2, Turns(tokenizer), SAMPLING, "step 1")
    assert out.rewards == [0.0] * 4 and out.metrics["env/errors"] == 4
    (summary,) = [r.getMessage() for r in caplog.records if r.name == RUNNER_LOG]
    assert (
        "first: step 1 prompt 0 sample 0: the constructor (Unbuildable) raised ValueError: "
        "no such board size" in summary
    )
    assert "reset()" not in summary
    assert "EVERY episode failed (1 step(s) in a row" in summary
    assert "raise ValueError" in (tmp_path / "logs" / "environments.log").read_text()
    with pytest.raises(UserError) as error:
        run.run(prompts(tokenizer, ["0"]), 1, Turns(tokenizer), SAMPLING, "step 2")
    message = str(error.value)
    assert "every episode failed in 2 step(s) in a row (environment.max_failed_steps: 2)" in message
    assert "the constructor (Unbuildable) raised ValueError" in message


def test_a_step_with_a_healthy_episode_ends_the_streak(tmp_path):
    failures = FailureLog("x", None, max_failed_steps=2)
    whole = [Failure("e0", "reset() raised E"), Failure("e1", "reset() raised E")]
    failures.step_done("step 1", whole, 2)
    failures.step_done("step 2", whole[:1], 2)  # one of two failed: not a failed step
    failures.step_done("step 3", whole, 2)
    with pytest.raises(UserError):
        failures.step_done("step 4", whole, 2)


def test_process_isolation_refuses_a_factory_it_cannot_send(tokenizer):
    spec = EnvironmentSpec(factory=lambda config: Countdown(config))
    config = EnvironmentConfig(name="local", isolation="process")
    with pytest.raises(UserError, match=r"cannot be pickled.*isolation: thread"):
        EpisodeRunner(spec, config, tokenizer)


DRIVER = """
import os, threading, time
from env_support import SLEEPS, Hostile
from posttrain.rollout.environments.process_pool import ProcessInstances
from posttrain.rollout.environments.protocol import EpisodePrompt, ModelTurn

pool = ProcessInstances("hostile", Hostile, {}, 1)
assert pool.create(["e"], 60.0)[0].error is None
pool.call("reset", [("e", EpisodePrompt(episode_id="e", text="", answer=SLEEPS, ids=()))], 60.0)
turn = ModelTurn(text="7", ids=(7,), index=1)
threading.Thread(target=pool.call, args=("step", [("e", turn)], 60.0), daemon=True).start()
time.sleep(0.5)  # the worker sleeps in step() now
print(pool.pids()[0], flush=True)
os._exit(0)  # the driver dies without closing its pool
"""


@pytest.mark.timeout(60)
def test_workers_do_not_outlive_their_driver():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    assert wait_gone([int(proc.stdout)]) == []
