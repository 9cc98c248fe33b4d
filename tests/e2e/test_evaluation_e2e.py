"""Held-out evaluation end to end on a short quickstart: ``val/*`` is logged before training and
every N steps, and ``posttrain eval`` on the last checkpoint reproduces the run's last
evaluation exactly (greedy decoding, the same weights). With asynchronous rollout the phase
takes the rollout engine from the producer thread and the run goes on."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import QUICKSTART, posttrain_cmd, read_metrics, run_env, run_quickstart, small_run

# actor_infer on a device of its own (the producer thread rolls out ahead of the trainer).
ASYNC = (
    *("--set", "algorithm.max_staleness=1"),
    *("--set", "actor_train.device_mapping=[0]", "--set", "reference.device_mapping=[0]"),
    *("--set", "actor_infer.device_mapping=[1]"),
)
# The quickstart's held-out problems, and the same scored by a fingerprint of each response;
# 4 new tokens (the training samples 1) so that responses differ in text and length.
EVALUATION = (
    "--set",
    "evaluation.datasets=[{name: heldout, synthetic: {task: single_digit_addition, split: "
    "held_out}}, {name: fingerprint, synthetic: {task: single_digit_addition, split: held_out},"
    " reward: {function: 'eval_rewards:fingerprint'}}]",
    *("--set", "evaluation.every_steps=2", "--set", "evaluation.before_training=true"),
    *("--set", "evaluation.max_new_tokens=4"),
)
METRICS = ("reward_mean", "mean@1", "pass@1", "response_length_mean", "prompts")


def held_out(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("val/")}


@pytest.mark.timeout(300)
def test_evaluation_logs_val_metrics_and_posttrain_eval_reproduces_the_last(tmp_path, e2e_cache):
    run_dir = tmp_path / "run"
    run = run_quickstart(run_dir, *small_run(max_steps=4, save_steps=4), *EVALUATION)
    assert "eval step 4: heldout reward" in run.stdout, run.stdout[-2000:]

    records = read_metrics(run_dir, "history.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    logged = read_metrics(run_dir)  # the jsonl logger's records: the same evaluations
    assert [held_out(r) for r in logged] == [held_out(r) for r in records]
    for record in records:
        evaluated = record["step"] % 2 == 0
        for name in ("heldout", "fingerprint"):
            for metric in METRICS:
                assert (f"val/{name}/{metric}" in record) == evaluated, record
        assert ("time/evaluate" in record) == evaluated
        if evaluated:
            assert record["val/heldout/prompts"] == 11
            assert 1 <= record["val/heldout/response_length_mean"] <= 4
            assert 0 < record["val/fingerprint/reward_mean"] < 1
    assert (run_dir / "curves.png").stat().st_size > 0
    last = held_out(records[-1])

    out = tmp_path / "report.json"
    proc = subprocess.run(
        posttrain_cmd(
            "eval",
            str(QUICKSTART),
            "--checkpoint",
            str(run_dir / "checkpoint-4"),
            "--out",
            str(out),
            *small_run(max_steps=4, save_steps=4),
            *EVALUATION,
            *("--set", f"trainer.output_dir={run_dir}"),
        ),
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = " ".join(proc.stdout.split())
    checkpoint = run_dir / "checkpoint-4"
    assert f"evaluating checkpoint {checkpoint} (step 4) on heldout, fingerprint" in printed
    assert "resumed from" not in printed  # nothing trains
    assert f"report: {out}" in printed
    report = json.loads(out.read_text())
    assert report["step"] == 4 and report["checkpoint"] == str(checkpoint)
    assert report["metrics"] == last  # greedy on the same weights: exactly equal
    # The report's summary follows its path: a line per dataset, its metrics as in the file.
    [line] = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("heldout:")]
    assert f"reward_mean {last['val/heldout/reward_mean']:.3f}" in line and "prompts 11" in line
    assert (run_dir / "eval" / "logs").is_dir()  # the eval's processes logged beside the run


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_evaluation_with_asynchronous_rollout(tmp_path, e2e_cache):
    run_dir = tmp_path / "async"
    no_checkpoint = ("--set", "trainer.save_final=false")
    every_step = ("--set", "evaluation.every_steps=1", "--set", "evaluation.before_training=false")
    run = run_quickstart(
        run_dir,
        *small_run(max_steps=2, save_steps=0),
        *ASYNC,
        *EVALUATION,
        *no_checkpoint,
        *every_step,
    )
    assert "eval step 2: heldout reward" in run.stdout, run.stdout[-2000:]
    records = read_metrics(run_dir, "history.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert "async/staleness" in record and record["val/heldout/prompts"] == 11, record
        # The phase's time includes any wait for the producer's generation under way.
        assert record["time/evaluate"] > 0
