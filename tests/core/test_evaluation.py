"""Held-out evaluation's parts: the pass@k estimator (closed form and brute force), the metrics
of scored groups, the held-out split of synthetic tasks, the ``evaluation:`` section's checks,
the held-out curve of curves.png, the engine the phase holds in asynchronous mode, and
``posttrain eval``'s refusals."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time

import pytest

from posttrain.cli import EXIT_USER, main
from posttrain.config.data_sections import DataConfig, SyntheticData
from posttrain.config.report import ErrorReport
from posttrain.evaluation.pass_at_k import group_metrics, k_values, pass_at_k
from posttrain.evaluation.phase import evaluates_after
from posttrain.loading.workflow import build_workflow
from posttrain.rollout.batches import AsyncBatches
from posttrain.tasks.data import read_records, synthetic_single_digit_addition
from posttrain.trainer.phase_timer import PhaseTimer

# -- pass@k --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 13))
def test_pass_at_k_is_the_closed_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_solved_sample(n):
    """Brute force: every set of k of the n samples, counted."""
    for c in range(n + 1):
        solved = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(solved, k))
            share = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(share, abs=1e-12), (n, c, k)


def test_pass_at_k_is_exact_at_large_n_and_refuses_impossible_counts():
    # C(200, 100) overflows a float; the product form does not need it.
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_k_values_are_powers_of_two_below_n_and_n():
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(10) == [1, 2, 4, 8, 10]


def test_group_metrics_of_two_prompts():
    # prompt 0: rewards 1, 0, 0, 1 (2 solved of 4); prompt 1: 0.5 four times (none solved)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    lengths = [1, 2, 3, 4, 5, 6, 7, 8]
    m = group_metrics(rewards, lengths, n=4, pass_reward=1.0)
    assert m["reward_mean"] == pytest.approx(4.0 / 8)
    assert m["mean@4"] == pytest.approx((0.5 + 0.5) / 2)
    assert m["pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)
    assert m["pass@4"] == pytest.approx((1 + 0) / 2)
    assert m["response_length_mean"] == pytest.approx(4.5)
    assert m["prompts"] == 2
    # with a lower bar, 0.5 solves
    assert group_metrics(rewards, lengths, n=4, pass_reward=0.5)["pass@1"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="whole groups"):
        group_metrics(rewards[:7], lengths[:7], n=4, pass_reward=1.0)


def test_evaluations_come_every_n_steps_and_after_the_last():
    assert [s for s in range(1, 11) if evaluates_after(s, 3, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 5) if evaluates_after(s, 2, 4)] == [2, 4]
    assert not any(evaluates_after(s, 0, 10) for s in range(1, 11))


# -- the held-out split --------------------------------------------------------------------------


def _split(split: str, fraction: float = 0.2) -> list[dict]:
    synthetic = SyntheticData(split=split, held_out_fraction=fraction)
    return read_records(DataConfig(synthetic=synthetic), ".")


def test_held_out_split_is_disjoint_from_train_and_fixed():
    every = synthetic_single_digit_addition()
    train, held_out = _split("train"), _split("held_out")
    assert len(held_out) == 11 and len(train) == 44
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held_out)
    assert sorted(map(str, train + held_out)) == sorted(map(str, every))
    assert held_out == _split("held_out")  # the same problems every time
    assert _split("all") == every
    assert len(_split("held_out", 0.5)) == 28


# -- the evaluation section's checks --------------------------------------------------------------


def _raw(model: str, evaluation: dict) -> dict:
    return {
        "model_args": {"model_name_or_path": model},
        "data": {"synthetic": {"task": "single_digit_addition", "split": "train"}},
        "algorithm": {"name": "grpo", "group_size": 4, "rollout_batch_size": 8},
        "actor_train": {
            "strategy_args": {"strategy_name": "contract_fake_train"},
            "device_mapping": [0, 1],
            "training_args": {"learning_rate": 1.0e-6},
        },
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}, "device_mapping": [0, 1]},
        "evaluation": evaluation,
    }


def _errors(raw, host, tmp_path) -> dict[str, str]:
    _, report = build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))
    return {issue.path: issue.render() for issue in report.errors}


HELD_OUT = {"name": "heldout", "synthetic": {"task": "single_digit_addition", "split": "held_out"}}


def test_a_valid_evaluation_section(fake_train_host, model_dir, tmp_path):
    raw = _raw(str(model_dir), {"datasets": [HELD_OUT], "every_steps": 50, "n": 1})
    workflow, report = build_workflow(raw, fake_train_host, ErrorReport(), base_dir=str(tmp_path))
    assert report.errors == []
    dataset = workflow.evaluation.datasets[0]
    assert dataset.name == "heldout" and dataset.synthetic.split == "held_out"
    assert dataset.reward is None and workflow.evaluation.temperature == 0.0


def test_typos_and_impossible_numbers_are_errors_with_their_paths(
    fake_train_host, model_dir, tmp_path
):
    evaluation = {
        "datasets": [
            {**HELD_OUT, "promt_key": "q"},
            {"synthetic": {"task": "single_digit_addition"}},
        ],
        "every_steps": -1,
        "n": 0,
        "max_prompts": 0,
        "temprature": 1.0,
    }
    errors = _errors(_raw(str(model_dir), evaluation), fake_train_host, tmp_path)
    assert "did you mean 'prompt_key'" in errors["evaluation.datasets[0].promt_key"]
    assert "name" in errors["evaluation.datasets[1].name"]  # required
    assert "-1 is out of range" in errors["evaluation.every_steps"]
    assert "0 is out of range" in errors["evaluation.n"]
    assert "0 is out of range" in errors["evaluation.max_prompts"]
    assert "did you mean 'temperature'" in errors["evaluation.temprature"]


def test_cross_field_mistakes_are_errors_all_at_once(fake_train_host, model_dir, tmp_path):
    evaluation = {
        "datasets": [
            {**HELD_OUT, "name": "a/b", "reward": {"function": "exact_mach"}},
            {"name": "x", "path": "missing.jsonl"},
            {"name": "x", "synthetic": {"task": "single_digit_addition"}, "path": "p.jsonl"},
            {"name": "none"},
        ],
        "n": 4,
    }
    errors = _errors(_raw(str(model_dir), evaluation), fake_train_host, tmp_path)
    assert "with greedy decoding" in errors["evaluation.n"]
    assert "cannot name metrics" in errors["evaluation.datasets[0].name"]
    assert "did you mean 'exact_match'" in errors["evaluation.datasets[0].reward.function"]
    assert "file not found" in errors["evaluation.datasets[1].path"]
    assert "names two datasets" in errors["evaluation.datasets[2].name"]
    assert "not both" in errors["evaluation.datasets[2]"]
    assert "no prompts" in errors["evaluation.datasets[3]"]
    scheduled = _raw(str(model_dir), {"every_steps": 10})
    errors = _errors(scheduled, fake_train_host, tmp_path)
    assert "no held-out dataset" in errors["evaluation.datasets"]


# -- curves.png ----------------------------------------------------------------------------------


def test_curves_draw_each_held_out_reward_beside_the_train_reward():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain.trainer.plotting import _plot_held_out

    history = [
        {"step": s, "reward/mean": s / 10, **({"val/heldout/reward_mean": s / 20} if s % 2 else {})}
        for s in range(1, 6)
    ]
    fig, ax = plt.subplots()
    _plot_held_out(ax, history)
    (line,) = ax.get_lines()
    assert line.get_label() == "eval: heldout"  # not "heldout (held out)"
    assert list(line.get_xdata()) == [1, 3, 5]
    assert list(line.get_ydata()) == [0.05, 0.15, 0.25]
    plt.close(fig)


def test_curves_show_the_turns_of_every_environment():
    from posttrain.trainer.plotting import curves_of

    plain = [{"step": 1, "reward/mean": 0.5}]
    game = [{"step": 1, "reward/mean": 0.5, "env/turns_mean": 2.5, "env/tool_call_rate": 0.0}]
    assert [k for k, _ in curves_of(plain)] == ["reward/mean", "actor/kl", "actor/entropy"]
    assert [k for k, _ in curves_of(game)][3:] == ["env/turns_mean", "env/tool_call_rate"]


# -- asynchronous rollout: the phase holds the engine ---------------------------------------------


def test_the_engine_held_for_evaluation_keeps_the_producer_out():
    generated: list[int] = []

    def produce(index, timer):
        generated.append(index)
        return f"batch {index}", {}, {"position": index}

    def timer():
        return PhaseTimer(console=None, total_steps=0, start_step=0, show=False)

    source = AsyncBatches(produce, 0, 1, first=1, last=3, make_timer=timer)
    try:
        source.next(1, timer())
        source.sync_weights(dict, version=1)  # step 1's sync: the producer may do step 3 now
        with source.engine():
            held = list(generated)
            time.sleep(0.3)
            # While evaluation holds the engine the producer generates nothing, and the engine
            # holds version 1, the trainer's.
            assert generated == held and source.version == 1
        deadline = time.monotonic() + 5
        while len(generated) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert generated == [1, 2, 3]
    finally:
        source.close()
    assert not any(t.name == "posttrain-rollout-producer" for t in threading.enumerate())


# -- posttrain eval: bad arguments ----------------------------------------------------------------


def test_eval_command_refuses_bad_arguments(tmp_path, capsys):
    workflow = tmp_path / "w.yaml"
    raw = _raw("preset:tiny-qwen2", {"datasets": [HELD_OUT]})
    raw["actor_train"]["strategy_args"]["strategy_name"] = "fsdp2_train"
    raw["trainer"] = {"output_dir": str(tmp_path / "run")}
    workflow.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as exc:
        main(["eval", str(workflow)])  # --checkpoint is required
    assert exc.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["eval", str(workflow), "--checkpoint", "latest"]) == EXIT_USER
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert main(["eval", str(workflow), "--checkpoint", str(tmp_path / "nope")]) == EXIT_USER
    assert "no such directory" in capsys.readouterr().err
    raw.pop("evaluation")
    workflow.write_text(json.dumps(raw))
    assert main(["eval", str(workflow), "--checkpoint", "latest"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "no evaluation.datasets" in err and "Traceback" not in err


def test_the_eval_summary_is_a_line_per_dataset():
    from posttrain.commands.evaluate import summary

    metrics = {
        "val/heldout/reward_mean": 0.72727,
        "val/heldout/pass@1": 0.72727,
        "val/heldout/prompts": 11.0,
        "val/gsm8k/test/reward_mean": 0.5,  # a name with a slash keeps it
    }
    assert summary(metrics) == [
        "  heldout: reward_mean 0.727, pass@1 0.727, prompts 11",
        "  gsm8k/test: reward_mean 0.500",
    ]
