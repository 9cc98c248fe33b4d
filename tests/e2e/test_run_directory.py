"""What later commands do to a run directory: a resume that would change the run is refused and
changes nothing; allowed, it continues on another layout, and every checkpoint still exports
(each records the workflow that saved it); Ctrl-C says what a rerun resumes from."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from conftest import QUICKSTART, posttrain_cmd, read_metrics, run_env, run_quickstart, small_run

ASYNC_LAYOUT = (
    "--set",
    "algorithm.max_staleness=1",
    "--set",
    "algorithm.tis_cap=2.0",
    "--set",
    "actor_train.device_mapping=[0]",
    "--set",
    "reference.device_mapping=[0]",
    "--set",
    "actor_infer.device_mapping=[1]",
)


def _tree(path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _export(checkpoint, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        posttrain_cmd("export-hf", str(checkpoint), str(out)),
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_changed_resume_is_refused_then_allowed_and_every_checkpoint_exports(tmp_path, e2e_cache):
    run_dir = tmp_path / "run"
    first = run_quickstart(run_dir, *small_run(2, 2))
    assert "2 rank processes, shared" in first.stdout
    before = _tree(run_dir)

    refused = run_quickstart(run_dir, *small_run(4, 2), *ASYNC_LAYOUT, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = " ".join(refused.stderr.split())
    assert "checkpoint-2 was saved by a different run" in message
    for change in (
        "algorithm.max_staleness: 0 -> 1",
        "algorithm.tis_cap: null -> 2.0",
        "actor_train.device_mapping: [0, 1] -> [0]",
        "actor_infer.device_mapping: [0, 1] -> [1]",
    ):
        assert change in message
    assert "--set trainer.output_dir=" in message
    assert "--set trainer.allow_resume_changes=true" in message
    assert "Traceback" not in refused.stderr
    assert _tree(run_dir) == before  # nothing written, nothing started

    allowed = run_quickstart(
        run_dir, *small_run(4, 2), *ASYNC_LAYOUT, "--set", "trainer.allow_resume_changes=true"
    )
    assert "done: 2 steps this run (steps 3-4)" in allowed.stdout
    assert [m["step"] for m in read_metrics(run_dir, "history.jsonl")] == [1, 2, 3, 4]
    # The run directory's workflow.yaml is the last run's (1 trainer rank); each checkpoint
    # exports with the workflow that saved it.
    for step, ranks in ((2, 2), (4, 1)):
        manifest = (run_dir / f"checkpoint-{step}" / "manifest.json").read_text()
        assert f'"world_size": {ranks}' in manifest
        proc = _export(run_dir / f"checkpoint-{step}", tmp_path / f"hf-{step}")
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert (tmp_path / f"hf-{step}" / "model.safetensors").exists()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_says_which_checkpoint_a_rerun_resumes_from(tmp_path, e2e_cache):
    run_dir = tmp_path / "run"
    overrides = ("--set", "trainer.max_steps=400", "--set", "trainer.save_steps=3")
    proc = subprocess.Popen(
        posttrain_cmd("run", str(QUICKSTART), *overrides, "--set", f"trainer.output_dir={run_dir}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env(),
        start_new_session=True,  # Ctrl-C reaches the whole foreground group: the ranks too
        # As a terminal's foreground job: a shell's background job (a CI script run with &)
        # starts with SIGINT ignored, which the driver would inherit and rightly keep.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    # Any checkpoint (older ones are rotated away) and a step after it; the run goes on.
    while time.monotonic() < deadline and proc.poll() is None:
        if any(run_dir.glob("checkpoint-*")) and len(_lines(metrics)) > 4:
            break
        time.sleep(0.05)
    # From another terminal: every process's stack, the run undisturbed.
    stacks = subprocess.run(
        posttrain_cmd("stacks", str(run_dir)), capture_output=True, text=True, timeout=60
    )
    assert stacks.returncode == 0, stacks.stdout + stacks.stderr
    heads = [line for line in stacks.stdout.splitlines() if line.startswith("== ")]
    assert [h.split(" (pid")[0] for h in heads] == [
        "== driver",
        "== actor_train+actor_infer+reference rank 0",
        "== actor_train+actor_infer+reference rank 1",
    ], stacks.stdout
    assert stacks.stdout.count('  File "') >= 3 * 3, stacks.stdout  # each a stack, not a line
    assert "rank_main.py" in stacks.stdout  # the ranks' serving loop
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    found = re.search(
        r"interrupted after step (\d+); the last complete checkpoint is (\S+)checkpoint-(\d+): "
        r"rerun the same command to continue from step (\d+)(, redoing steps? (\d+)(-(\d+))?)?",
        " ".join(err.split()),
    )
    assert found, err
    done, saved = int(found[1]), int(found[3])
    assert int(found[4]) == saved
    if done > saved:  # else the Ctrl-C came between a checkpoint and the next step
        assert int(found[6]) == saved + 1 and int(found[8] or found[6]) == done
    assert max(m["step"] for m in read_metrics(run_dir)) == done
    assert saved == max(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*"))
    assert not (run_dir / "logs" / "processes.json").exists()  # listed only while they live
    gone = subprocess.run(posttrain_cmd("stacks", str(run_dir)), capture_output=True, text=True)
    assert gone.returncode == 2 and "no live run in" in gone.stderr, gone.stderr


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
