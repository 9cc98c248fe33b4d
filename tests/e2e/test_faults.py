"""Disk and checkpoint faults, made by the fault kit (posttrain.testing.faults): a save that
finds the disk full stops the run with the figures and leaves the previous checkpoint whole; a
corrupted shard is named at resume, and ``trainer.resume_fallback`` resumes from the one before."""

from __future__ import annotations

import re

import pytest
from conftest import read_metrics, run_env, run_quickstart, small_run

from posttrain.checkpoint.manifest import verify

FAULTS = ("--set", "plugins=[posttrain.testing.faults]")


def run(run_dir, max_steps: int, *extra: str, faults: str = "", check=True):
    return run_quickstart(
        run_dir,
        *small_run(max_steps=max_steps, save_steps=2),
        *FAULTS,
        *extra,
        env=run_env(POSTTRAIN_FAULTS=faults),
        check=check,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, e2e_cache):
    run_dir = tmp_path / "full"
    proc = run(run_dir, 6, faults="enospc_save:2", check=False)  # the save of step 4
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "checkpoint 4 could not be written: no space left on the device of" in err, err
    assert "GiB free); a checkpoint of this run takes about" in err, err
    assert "checkpoint-2 is complete and untouched" in err, err
    assert "the run stopped after step 4" in err and "rerun the same command" in err, err
    verify(str(run_dir / "checkpoint-2"))  # whole: every file as its manifest says
    assert not (run_dir / "checkpoint-4").exists()
    assert not (run_dir / "logs" / "processes.json").exists()  # no rank left


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_corrupted_shard_is_named_and_resume_falls_back_when_asked(tmp_path, e2e_cache):
    run_dir = tmp_path / "flipped"
    run(run_dir, 4, faults="flip_saved_byte:2")  # checkpoint-4, once complete
    longer = ("--set", "trainer.max_steps=6")
    refused = run(run_dir, 4, *longer, check=False)
    err = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "checkpoint-4: file actor_train/" in err and "is corrupted" in err, err
    assert "--set trainer.resume_fallback=true" in err, err
    resumed = run(run_dir, 4, *longer, "--set", "trainer.resume_fallback=true")
    out = " ".join(resumed.stdout.split())
    assert "is corrupted" in out and "resuming from" in out and "checkpoint-2 instead" in out
    assert "done: 4 steps this run (steps 3-6)" in out, out[-2000:]
    assert [m["step"] for m in read_metrics(run_dir)][-4:] == [3, 4, 5, 6]


ASYNC = (
    *("--set", "algorithm.max_staleness=1", "--set", "actor_infer.device_mapping=[1]"),
    *("--set", "actor_train.device_mapping=[0]", "--set", "reference.device_mapping=[0]"),
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_weight_corrupted_in_a_sync_stops_the_run_naming_it(tmp_path, e2e_cache):
    """Over the broadcast transport (asynchronous layout); the in-process hand-over checks the
    same way (tests/core/test_weight_transports.py, tests/core/test_sync_verify.py)."""
    run_dir = tmp_path / "corrupted"
    proc = run(run_dir, 4, *ASYNC, faults="corrupt_sync:2", check=False)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"weight sync into actor_infer \(hf_infer\) rank \d: 1 of the bucket's", err)
    assert "differ from what the trainer sent (byte sums): model.embed_tokens.weight" in err, err
    assert len(read_metrics(run_dir)) == 1  # step 1 logged; step 2's sync stopped the run
    assert not (run_dir / "logs" / "processes.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_weight_renamed_in_a_sync_stops_the_run_naming_both_names(tmp_path, e2e_cache):
    """An engine upgrade that renamed a parameter, at the first sync (in process)."""
    run_dir = tmp_path / "renamed"
    proc = run(run_dir, 2, faults="rename_sync:1", check=False)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "the trainer's weights do not match the rollout engine's" in err, err
    assert re.search(
        r"sent model\.renamed\.(\S+) \[[\d, ]+\], a name the engine lacks \(the engine's closest "
        r"weight of that shape: model\.\1\)",
        err,
    ), err
    assert not (run_dir / "logs" / "processes.json").exists()
