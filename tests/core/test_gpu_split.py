"""The trainer/rollout GPU split from a run's phase times (posttrain.memory.split, ``posttrain
plan WORKFLOW --from-run RUN_DIR``): the model on synthetic metrics, the memory plan refusing a
split, and the command end to end on a synthetic run directory. No process starts a rank."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.checkpoint.record import workflow_record
from posttrain.host.plugin_host import create_plugin_host
from posttrain.loading.workflow import load_workflow
from posttrain.memory.estimate import GIB
from posttrain.memory.split import (
    BROADCAST_GB_S,
    Fit,
    best_split,
    candidate_workflow,
    candidates,
    check_fit,
    phase_times,
    print_split,
    read_run,
    yaml_lines,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
# Qwen2-1.5B's geometry (a config.json is all the plan reads): its trainer's weights, gradients
# and Adam state fill one GPU's share of the plan visibly more on 1 trainer GPU than on 2.
QWEN2_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
ASYNC_1_1 = {
    "actor_train.device_mapping": [0],
    "reference.device_mapping": [0],
    "actor_infer.device_mapping": [1],
    "algorithm.max_staleness": 1,
}


def async_step(step: int, rollout: float, trainer: float = 3.0, sync: float = 0.5) -> dict:
    """An asynchronous step's metrics as the loop logs them: the producer's rollout, the
    trainer's log-probs and update, the sync (the rank's seconds beside the phase's)."""
    return {
        "step": step,
        "async/rollout_s": rollout,
        "async/reward_s": 0.0,
        "time/wait_rollout": max(0.0, rollout - trainer),
        "time/logprobs": trainer / 3,
        "time/train": trainer * 2 / 3,
        "time/weight_sync": sync + 0.3,  # waited for the engine between two generations
        "rank_time/weight_sync_s": sync,
        "time/outside_phases": 0.0,
        "time/step": max(rollout, trainer) + sync + 0.3,
        "weight_sync/mb": 2944.0,
        "async/staleness": 1.0,
    }


def write_run(run_dir: Path, overrides: dict, steps: list[dict]) -> Path:
    """A run directory as a run leaves it: its workflow record and its metrics.jsonl."""
    host = create_plugin_host()
    workflow, report = load_workflow(str(QUICKSTART), host, overrides)
    assert not report.errors, report.errors
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "workflow.yaml").write_bytes(workflow_record(workflow, str(QUICKSTART)))
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "time/evaluate": 1.0}) + "\n")  # before training
        f.writelines(json.dumps(step) + "\n" for step in steps)
    return run_dir


@pytest.fixture(scope="module")
def host():
    return create_plugin_host()


@pytest.fixture(scope="module")
def model_1_5b(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2-1.5b")
    (path / "config.json").write_text(json.dumps(QWEN2_1_5B))
    return str(path)


def bf16_1_5b(model: str) -> dict:
    return {
        "model_args.model_name_or_path": model,
        "model_args.dtype": "bf16",
        "actor_train.training_args.per_device_train_batch_size": 4,
        "actor_infer.infer_batch_size": 8,
        "reference.infer_batch_size": 8,
    }


def test_phase_times_are_medians_after_the_first_step(tmp_path):
    steps = [async_step(1, rollout=60.0)] + [async_step(s, rollout=9.0) for s in range(2, 8)]
    times, layout, _, path = read_run(write_run(tmp_path / "run", ASYNC_1_1, steps))
    assert path.endswith("metrics.jsonl")
    assert times.asynchronous and times.steps == 6
    assert times.rollout == times.rollout_p90 == 9.0  # the first step's compile left out
    assert times.trainer == pytest.approx(3.0)
    # Asynchronous: the ranks' sync, not the phase's wait for the engine.
    assert times.sync == 0.5
    assert (layout.trainer_gpus, layout.rollout_gpus, layout.gpus) == (1, 1, 2)
    assert not layout.colocated and layout.max_staleness == 1

    synchronous = phase_times(
        [
            {"step": s, "time/rollout": r, "time/train": 2.0, "time/step": r + 2.5}
            for s, r in ((1, 30.0), (2, 4.0), (3, 6.0), (4, 5.0))
        ]
    )
    assert not synchronous.asynchronous
    assert (synchronous.rollout, synchronous.rollout_p90, synchronous.trainer) == (5.0, 6.0, 2.0)


def test_balanced_sides_get_the_split_that_balances_them_and_staleness_1(tmp_path):
    steps = [async_step(s, rollout=9.0) for s in range(1, 8)]
    times, layout, _, _ = read_run(write_run(tmp_path / "run", ASYNC_1_1, steps))
    rows = {p.label: p for p in candidates(times, layout, 4)}
    assert set(rows) == {"1 + 3", "2 + 2", "3 + 1", "4 colocated"}
    # 1 + 3: the trainer's 3 s on one GPU, the rollout's 9 s over three: max(3, 3) + 0.5.
    one_three = rows["1 + 3"]
    assert one_three.step == pytest.approx(3.5)
    assert one_three.on_policy_step == pytest.approx(6.5)
    assert one_three.trainer_idle == pytest.approx(0.0) and one_three.rollout_idle == pytest.approx(
        0
    )
    # 3 + 1: the rollout bounds the step; the trainer waits 8 of its 9.5 s.
    assert rows["3 + 1"].step == pytest.approx(9.5)
    assert rows["3 + 1"].trainer_idle == pytest.approx(8 / 9.5)
    assert rows["3 + 1"].staleness == 1  # the rollout is the long pole: nothing to bank
    best = best_split([(p, Fit(valid=True, fits=True)) for p in rows.values()])
    assert best is rows["1 + 3"] and best.staleness == 1
    assert best.steps_per_hour == pytest.approx(3600 / 3.5)


def test_a_long_tailed_rollout_gets_more_staleness(tmp_path):
    # Typical batches roll out in 4 s, one in five takes 12 s; the trainer's part is 6 s.
    rollouts = [40.0] + [4.0, 4.0, 4.0, 4.0, 12.0] * 2
    steps = [async_step(s, rollout=r, trainer=6.0) for s, r in enumerate(rollouts, start=1)]
    times, layout, _, _ = read_run(write_run(tmp_path / "run", ASYNC_1_1, steps))
    assert (times.rollout, times.rollout_p90) == (4.0, 12.0)
    rows = candidates(times, layout, 4)
    best = best_split([(p, Fit(valid=True, fits=True)) for p in rows])
    # 2 + 2: trainer 3 s, rollout 2 s typical and 6 s at p90: two batches banked cover it.
    assert (best.trainer_gpus, best.rollout_gpus) == (2, 2)
    assert best.step == pytest.approx(3.5)
    assert best.staleness == 2
    one_one = candidates(times, layout, 2)[0]
    assert one_one.staleness == 2  # p90 12 s over the trainer's 6 s


def test_a_colocated_run_prices_a_disaggregated_sync_by_its_bytes(tmp_path):
    hybrid = {"actor_train.device_mapping": [0, 1], "reference.device_mapping": [0, 1]}
    hybrid["actor_infer.device_mapping"] = [0, 1]
    steps = [
        {
            "step": s,
            "time/rollout": 4.0,
            "time/reward": 0.2,
            "time/logprobs": 1.0,
            "time/train": 3.0,
            "time/weight_sync": 0.02,
            "time/outside_phases": 0.3,
            "time/step": 8.52,
            "weight_sync/mb": 2944.0,
        }
        for s in range(1, 5)
    ]
    times, layout, _, _ = read_run(write_run(tmp_path / "run", hybrid, steps))
    assert layout.colocated and layout.gpus == 2 and not times.asynchronous
    split, together = candidates(times, layout, 2)
    assert together.colocated and together.step == pytest.approx(8.52)  # the run itself
    assert together.sync == 0.02  # in process, as measured
    assert split.sync == pytest.approx(2944 * 2**20 / (BROADCAST_GB_S * 1e9))
    # 1 + 1: the trainer's 4 s of work on 2 GPUs now on one, the rollout's 8 likewise.
    assert split.trainer_side == pytest.approx(8.3) and split.rollout_side == pytest.approx(8.2)

    # The command compares the best split with the run's own colocated layout, as measured.
    host = create_plugin_host()
    workflow, _ = load_workflow(str(QUICKSTART), host, hybrid)
    out = io.StringIO()
    console = Console(file=out, width=1000, highlight=False)
    assert print_split(workflow, host, console, str(tmp_path / "run"), None, 80)
    text = out.getvalue()
    assert "synchronous, colocated, trainer on 2 GPU(s), rollout on 2" in text
    assert "best split: 1 trainer + 1 rollout GPUs, max_staleness 1" in text
    assert "against the run's own colocated layout (8.52 s a step): 1.02x" in text


def test_a_split_whose_memory_plan_does_not_fit_is_refused(tmp_path, host, model_1_5b):
    workflow, report = load_workflow(str(QUICKSTART), host, bf16_1_5b(model_1_5b))
    assert not report.errors
    steps = [async_step(s, rollout=9.0) for s in range(1, 6)]
    times, layout, _, _ = read_run(write_run(tmp_path / "run", ASYNC_1_1, steps))
    rows = {p.label: p for p in candidates(times, layout, 4)}
    capacity = 28 * GIB
    fits = {
        label: check_fit(candidate_workflow(workflow, p, 0), host, capacity)
        for label, p in rows.items()
    }
    # One trainer GPU holds all of 1.5B's weights, gradients and Adam state: over 28 GiB,
    # checkpointed or not (auto turns checkpointing on there).
    assert fits["1 + 3"].valid and fits["1 + 3"].fits is False
    assert "GPU 0, train" in fits["1 + 3"].reason
    assert fits["2 + 2"].fits is True and fits["2 + 2"].peak < fits["1 + 3"].peak
    # 256 samples do not split over 3 trainer ranks: refused by validation.
    assert not fits["3 + 1"].valid and "3 data-parallel ranks" in fits["3 + 1"].reason
    best = best_split([(rows[label], fit) for label, fit in fits.items()])
    assert best is rows["2 + 2"]  # 1 + 3 predicts the shorter step, but does not fit
    assert best_split([(rows["1 + 3"], fits["1 + 3"]), (rows["3 + 1"], fits["3 + 1"])]) is None

    lines = yaml_lines(candidate_workflow(workflow, best, best.staleness))
    assert lines == [
        "actor_train.device_mapping: [0, 1]",
        "reference.device_mapping: [0, 1]",
        "actor_infer.device_mapping: [2, 3]",
        "algorithm.max_staleness: 1",
    ]


def plan_from_run(run_dir: Path, *args: str, overrides: dict | None = None):
    sets = [f"--set={k}={json.dumps(v)}" for k, v in (overrides or {}).items()]
    command = [sys.executable, "-m", "posttrain.cli", "plan", str(QUICKSTART), *sets]
    return subprocess.run(
        [*command, "--from-run", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_posttrain_plan_from_run_prints_the_splits_and_the_lines_to_paste(tmp_path, model_1_5b):
    model = bf16_1_5b(model_1_5b)
    steps = [async_step(s, rollout=9.0) for s in range(1, 6)]
    run_dir = write_run(tmp_path / "run", {**model, **ASYNC_1_1}, steps)

    roomy = plan_from_run(run_dir, "--gpus", "4", "--gpu-memory-gib", "80", overrides=model)
    assert roomy.returncode == 0, roomy.stderr
    out = roomy.stdout
    assert "Traceback" not in roomy.stderr and "warning" not in roomy.stderr
    for column in ("split", "staleness", "step s", "steps/h", "trainer idle", "memory"):
        assert column in out
    assert "1 + 3" in out and "2 + 2" in out and "4 colocated" in out
    assert "the model at the run's own layout: 9.5 s a step (measured 9.8)" in out
    assert "best split: 1 trainer + 3 rollout GPUs, max_staleness 1" in out
    assert "  actor_train.device_mapping: [0]\n" in out
    assert "  reference.device_mapping: [0]\n" in out
    assert "  actor_infer.device_mapping: [1, 2, 3]\n" in out
    assert "  algorithm.max_staleness: 1\n" in out
    assert '--set "actor_infer.device_mapping=[1, 2, 3]"' in out

    tight = plan_from_run(run_dir, "--gpus", "4", "--gpu-memory-gib", "28", overrides=model)
    assert tight.returncode == 0, tight.stderr
    assert "does not fit" in tight.stdout
    assert "best split: 2 trainer + 2 rollout GPUs" in tight.stdout
    assert "  actor_infer.device_mapping: [2, 3]\n" in tight.stdout


def test_plan_from_run_exits_2_where_no_split_fits_or_there_is_no_run(tmp_path, model_1_5b, capsys):
    from posttrain.cli import main

    model = bf16_1_5b(model_1_5b)
    steps = [async_step(s, rollout=9.0) for s in range(1, 6)]
    run_dir = write_run(tmp_path / "run", {**model, **ASYNC_1_1}, steps)
    sets = [f"--set={k}={json.dumps(v)}" for k, v in model.items()]
    plan = ["plan", str(QUICKSTART), *sets, "--from-run"]

    assert main([*plan, str(run_dir), "--gpus", "4", "--gpu-memory-gib", "4"]) == 2
    assert "no split of 4 GPUs is valid and fits" in capsys.readouterr().out
    # The run's own GPUs by default.
    assert main([*plan, str(run_dir), "--gpu-memory-gib", "80"]) == 0
    assert "best split: 1 trainer + 1 rollout GPUs" in capsys.readouterr().out
    # What asynchronous rollout also needs of this workflow is named under the lines.
    epochs = ["--set=algorithm.ppo_epochs=2", "--gpu-memory-gib", "80"]
    assert main([*plan, str(run_dir), *epochs]) == 0
    out = capsys.readouterr().out
    assert "also needed: algorithm.tis_cap" in out
    assert "the workflow differs from the run's beyond its layout (algorithm.ppo_epochs" in out
    # A directory that is not a run, and --gpus alone, are user errors.
    assert main([*plan, str(tmp_path / "nothing"), "--gpu-memory-gib", "80"]) == 2
    err = capsys.readouterr().err
    assert "has no workflow.yaml" in err and "Traceback" not in err
    assert main(["plan", str(QUICKSTART), "--gpus", "4"]) == 2
    assert "--gpus N goes with --from-run" in capsys.readouterr().err
