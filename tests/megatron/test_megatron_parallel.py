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
    # Each sequence in 4 chunks, 2 per rank; attention gathers keys and values over CP.
    "cp2": ({"context_parallel_size": 2}, 2, None),
    # Each micro-batch's sequences packed into one row (THD), with TP + SP and with PP + VPP.
    "tp2_sp_packed": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "pack_sequences": True},
        2,
        None,
    ),
    "pp2_vpp2_packed": (
        {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "pack_sequences": True,
        },
        2,
        None,
    ),
    # CP composed with TP + SP and with the interleaved pipeline (4 ranks).
    "tp2_sp_cp2": (
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "context_parallel_size": 2},
        4,
        None,
    ),
    "pp2_vpp2_cp2": (
        {
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
        },
        4,
        None,
    ),
}


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory):
    from megatron_workers import build_hf_model

    return build_hf_model(str(tmp_path_factory.mktemp("qwen2") / "model"), "qwen2")


# The checkpoint scenario: TP2 saves after step 1; the checkpoint resumes at TP1 and at PP2.
RESUMES = {
    "resume_tp1": {},
    "resume_pp2": {"pipeline_model_parallel_size": 2},
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, qwen2_path):
    """``runs(tag)``: the results of scenario ``tag`` (the TP1 reference, a layout, or a resume),
    run once on first use, so ``-k`` selects only the runs its tests need."""
    from megatron_workers import launch

    out = str(tmp_path_factory.mktemp("megatron-runs"))
    done: set[str] = set()

    def run(tag: str) -> None:
        if tag in done:
            return
        if tag == "tp1":
            launch("train", 1, out, model=qwen2_path, tag=tag)
        elif tag == "tp2_saved":
            tp2 = {"tensor_model_parallel_size": 2}
            launch("train", 2, out, model=qwen2_path, tag=tag, layout=tp2, save_after=1)
        elif tag in RESUMES:
            run("tp2_saved")
            layout = RESUMES[tag]
            world = 2 if layout else 1
            launch(
                "train", world, out, model=qwen2_path, tag=tag, load="ckpt_tp2_saved", layout=layout
            )
        else:
            layout, world, training = LAYOUTS[tag]
            launch("train", world, out, model=qwen2_path, tag=tag, layout=layout, training=training)
        done.add(tag)

    def load(name: str, tag: str | None = None) -> dict:
        run(tag or name)
        return torch.load(f"{out}/{name}.pt", weights_only=False)

    return load


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.extended
@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_layout_matches_tp1_after_two_steps(runs, qwen2_path, tag):
    from megatron_workers import DEVICE
    from safetensors.torch import load_file

    world = LAYOUTS[tag][1]
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"{tag} needs {world} GPUs")

    ref, other = runs("tp1"), runs(tag)
    assert _max_diff(ref["params"], other["params"]) < 1e-4
    # The steps did move the weights (a comparison of untouched models proves nothing).
    initial = load_file(f"{qwen2_path}/model.safetensors")
    assert _max_diff(initial, {k: ref["params"][k] for k in initial}) > 1e-4
    for a, b in zip(ref["metrics"], other["metrics"]):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-3)


def test_checkpoint_saved_at_tp2_resumes_at_tp1_and_pp2(runs):
    uninterrupted = runs("tp2_saved")["params"]
    for tag in RESUMES:
        resumed = runs(f"resumed_{tag}", tag)
        assert resumed["step"] == 1 and resumed["updates"] == 1
        # Adam's step count per parameter: one update so far, not one shared counter.
        assert resumed["adam"] == [1.0]
        final = runs(tag)
        assert final["adam"] == [2.0]
        assert _max_diff(uninterrupted, final["params"]) < 1e-5
