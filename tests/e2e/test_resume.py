"""A run killed with SIGKILL (between checkpoints, and while writing one) resumes with
``resume: auto`` and ends bitwise equal to an uninterrupted run; a run whose stacks are asked for
over and over ends as the uninterrupted run did."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    HANG_AT_STEP_5,
    QUICKSTART,
    assert_hang_reported,
    kill_after_checkpoint,
    posttrain_cmd,
    read_metrics,
    run_env,
    run_quickstart,
    small_run,
)
from safetensors.torch import load_file

SMALL = small_run(max_steps=10, save_steps=3)


def run(run_dir: Path, *extra: str, env=None, check=True) -> subprocess.CompletedProcess:
    return run_quickstart(run_dir, *SMALL, *extra, env=env, check=check)


def final_weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        posttrain_cmd("export-hf", str(run_dir / "checkpoint-10"), str(out)),
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def rewards_by_step(run_dir: Path) -> dict[int, float]:
    # A resumed run appends: the later line of a step wins, as it does in the checkpoint.
    return {m["step"]: m["reward/mean"] for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, e2e_cache):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run(run_dir)
    return run_dir, final_weights(run_dir, run_dir / "hf")


def assert_same_run(resumed: Path, uninterrupted) -> None:
    reference_dir, reference_weights = uninterrupted
    assert rewards_by_step(resumed) == rewards_by_step(reference_dir)
    weights = final_weights(resumed, resumed / "hf")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name


# In the default run, test_random_kills.py's chains kill at such points (extended: this one
# kills at fixed points and checks more of what the console says).
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_between_checkpoints_then_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(QUICKSTART, run_dir, *SMALL)
    resumed = run(run_dir)
    assert resumed_at(resumed.stdout) == 3
    assert "done: 7 steps this run (steps 4-10)" in " ".join(resumed.stdout.split())
    # Each step once in the log and in the run's history (the killed run's steps after 3
    # replaced); checkpoints hold the driver's position, never a copy of the history.
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 11))
    assert [m["step"] for m in read_metrics(run_dir, "history.jsonl")] == list(range(1, 11))
    state = json.loads((run_dir / "checkpoint-10" / "driver_state.json").read_text())
    assert set(state) == {"step", "sampler", "ahead"} and state["ahead"] == []  # synchronous
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_while_writing_a_checkpoint_then_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed-in-save"
    crash = run(
        run_dir,
        "--set",
        "plugins=[crash_plugin]",
        check=False,
        env=run_env(POSTTRAIN_TEST_CRASH_AT_CHECKPOINT="6"),
    )
    assert crash.returncode == -signal.SIGKILL
    # The interrupted checkpoint was never renamed into place; the previous one is intact.
    assert (run_dir / ".checkpoint-6.tmp").exists()
    assert not (run_dir / "checkpoint-6").exists()
    assert (run_dir / "checkpoint-3" / "manifest.json").exists()
    run(run_dir)
    assert not (run_dir / ".checkpoint-6.tmp").exists()
    assert_same_run(run_dir, uninterrupted)


# Kill points across the phases of a background save (see save_kill_plugin): (step whose save
# is interrupted, process, n-th file-system event of that save in it). Each run resumes from
# the previous kill; save_total_limit: 2 puts the removal of old checkpoints in the save too.
# One point per phase (each costs a run's start-up): rank 0's own writes (extras, .metadata) are
# the same phases as rank 1's, seen from the coordinator.
SAVE_KILLS = [
    ("3", "driver", 2),  # temporary directory made, ranks not yet asked
    ("3", "rank1", 4),  # background write: DCP data file
    ("3", "rank1", 6),  # rank's completion marker moved into place
    ("3", "driver", 7),  # manifest written, checkpoint not yet renamed into place
    ("6", "driver", 4),  # finaliser consuming the markers
    ("9", "driver", 8),  # renamed into place, retiring the oldest checkpoint
    ("10", "driver", 9),  # the oldest retired (out of sight), its files being removed
]


def complete_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints a resume may use; each must verify in full."""
    from posttrain.checkpoint.manifest import verify

    steps = []
    for path in sorted(run_dir.glob("checkpoint-*")):
        verify(str(path))  # never a directory that looks complete but is not
        steps.append(int(path.name.split("-")[1]))
    return sorted(steps)


def resumed_at(stdout: str) -> int | None:
    """The step a run resumed at, from its console line (which the console may wrap)."""
    _, found, rest = stdout.partition("resumed from")
    return int(re.search(r"at\s+step\s+(\d+)", rest).group(1)) if found else None


# In the default run, test_random_kills.py's chains kill at such points (extended: this one
# kills at fixed points and checks more of what the console says).
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_during_background_saves_then_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "killed-in-background-saves"
    log = tmp_path / "save-events.log"
    for step, who, n in SAVE_KILLS:
        before = complete_checkpoints(run_dir) if run_dir.exists() else []
        killed = run(
            run_dir,
            "--set",
            "plugins=[save_kill_plugin]",
            "--set",
            "trainer.save_total_limit=2",
            check=False,
            env=run_env(
                POSTTRAIN_TEST_SAVE_KILL=f"{step}:{who}:{n}", POSTTRAIN_TEST_SAVE_KILL_LOG=str(log)
            ),
        )
        assert killed.returncode == -signal.SIGKILL, (step, who, n, killed.stderr[-2000:])
        last = [line for line in log.read_text().splitlines() if line.startswith(who)][-1]
        assert last.startswith(f"{who} {n} "), last  # the kill landed where it was aimed
        assert resumed_at(killed.stdout) == (before[-1] if before else None)
        complete_checkpoints(run_dir)
    resumed = run(run_dir, "--set", "trainer.save_total_limit=2")
    assert re.search(r"nothing to run: \S+checkpoint-10 is at step 10", resumed.stdout)
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_blocked_rank_is_reported_then_the_run_stops_and_resumes_bitwise(tmp_path, uninterrupted):
    """Rank 0 blocks at the start of step 5's update (hang_plugin); rank 1 goes on into the
    update's collectives. The watchdog reports at hang_report_s; rank 1's collective times out at
    collective_timeout_s, and the run stops, before call_timeout_s, saying how to resume."""
    run_dir = tmp_path / "hung"
    hung = run(run_dir, *HANG_AT_STEP_5, check=False)
    err = assert_hang_reported(run_dir, hung)
    assert re.search(
        r"the run stopped after step 4; the last complete checkpoint is \S+checkpoint-3: "
        r"rerun the same command to continue from step 3, redoing step 4",
        err,
    ), err
    run(run_dir)
    assert_same_run(run_dir, uninterrupted)


STACKS_CALLS = 200


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stacks_asked_200_times_of_a_busy_run_leave_it_as_an_uninterrupted_run(
    tmp_path, uninterrupted
):
    """``posttrain stacks``'s collection, called in a loop on a live run whose processes run
    threads that push and pop frames and start and end threads (busy_threads_plugin): the
    stacks asked for in a signal handler, by faulthandler, crashed such a process within tens
    of calls. Every call answers for every process, and the run ends as the uninterrupted one."""
    from posttrain.errors import UserError
    from posttrain.launch.stacks import live_run_stacks

    run_dir = tmp_path / "asked"
    release = tmp_path / "asked-enough"
    proc = subprocess.Popen(
        posttrain_cmd(
            "run",
            str(QUICKSTART),
            *SMALL,
            "--set",
            "plugins=[busy_threads_plugin]",
            "--set",
            f"trainer.output_dir={run_dir}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The driver waits after step 9 until the asking is done: 200 calls on a live run
        # on a slow machine too (about 70 ms a call on 2 loaded cores; steps take less).
        env=run_env(
            POSTTRAIN_TEST_BUSY_THREADS="1",
            POSTTRAIN_TEST_BUSY_HOLD_AT_STEP="9",
            POSTTRAIN_TEST_BUSY_RELEASE=str(release),
        ),
    )
    listed = run_dir / "logs" / "processes.json"
    deadline = time.monotonic() + 240
    while not listed.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    answers = []
    started = time.monotonic()
    try:
        while len(answers) < STACKS_CALLS and proc.poll() is None:
            try:
                answers.append(live_run_stacks(str(run_dir)))
            except UserError:  # the run ended: its processes are listed no more
                break
            time.sleep(0.02)  # spread over more of the run's phases
    finally:
        release.touch()
    asked_s = time.monotonic() - started
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert len(answers) == STACKS_CALLS, f"the run ended after {len(answers)} in {asked_s:.0f}s"
    for text in answers:
        heads = [line.split(" (pid")[0] for line in text.splitlines() if line.startswith("== ")]
        assert heads == [
            "== driver",
            "== actor_train+actor_infer+reference rank 0",
            "== actor_train+actor_infer+reference rank 1",
        ], text
        assert text.count('  File "') >= 3, text  # a stack of each process, not a line
        assert "faulthandler" not in text, text  # each process answered from its own thread
    assert rewards_by_step(run_dir) == rewards_by_step(uninterrupted[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_dead_of_sigsegv_is_reported_with_its_stack_and_the_rerun_line(tmp_path):
    """Rank 1 dies of SIGSEGV at the start of step 5's update (kill_plugin): the console names
    the rank and the signal, shows the stack faulthandler wrote into the rank's log, and says
    what a rerun does."""
    run_dir = tmp_path / "segfault"
    crashed = run(
        run_dir,
        "--set",
        "plugins=[kill_plugin]",
        check=False,
        env=run_env(POSTTRAIN_TEST_KILL_AT_STEP="5", POSTTRAIN_TEST_KILL_SIGNAL="SIGSEGV"),
    )
    assert crashed.returncode == 1, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    err = crashed.stderr
    assert "Traceback" not in err, err
    flat = " ".join(err.split())
    assert "actor_train rank 1" in flat and "worker process died of SIGSEGV during" in flat, err
    assert "Fatal Python error: Segmentation fault" in err, err
    stack = err[err.index("Current thread 0x") :]
    assert re.search(r'File "\S+kill_plugin\.py", line \d+ in posttrain_train_step', stack), err
    assert "rank_main.py" in stack, err  # the whole stack, down to the rank's serving loop
    assert re.search(
        r"the run stopped after step 4; the last complete checkpoint is \S+checkpoint-3: "
        r"rerun the same command to continue from step 3, redoing step 4",
        flat,
    ), err
