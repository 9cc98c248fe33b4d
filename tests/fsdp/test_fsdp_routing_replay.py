"""Routing replay in fsdp2_train (algorithm.routing_replay) on the tiny MoE preset, with
hf_infer as the rollout: after a weight sync, the trainer replays the rollout's experts and its
log-probs of the sampled tokens are the rollout's (fp32); old_policy replays the old-policy
pass's routing in the update."""

from __future__ import annotations

import pytest
import torch


def _run(tmp_path_factory, infer_dtype: str) -> dict:
    from routing_replay_workers import MOE

    from posttrain.tasks.presets import preset_path
    from posttrain.testing.spawn import run_ranks

    preset_path(MOE)  # built once, before the rank starts
    out = tmp_path_factory.mktemp("fsdp-routing")
    run_ranks(
        "routing_replay_workers:scenario_replay",
        1,
        str(out),
        timeout=240.0,
        infer_dtype=infer_dtype,
    )
    return torch.load(out / f"replay_fsdp2_train_{infer_dtype}.pt", weights_only=False)


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    return _run(tmp_path_factory, "fp32")


@pytest.mark.timeout(300)
def test_the_trainer_replays_the_rollouts_experts(replay):
    print(
        f"rollout-vs-trainer log-prob gap, fp32: without replay {replay['gap_off']}, with "
        f"{replay['gap_rollout']}; trainer's own routing agrees on "
        f"{replay['own_agreement']:.3f} of (token, layer) top-k sets"
    )
    assert replay["routing_dtype"] == "torch.uint8"
    assert replay["trainer_used_recorded"]
    assert replay["gap_rollout"]["max"] < 1e-5
    assert replay["gap_rollout"]["max"] <= replay["gap_off"]["max"]
    assert replay["gap_shifted"]["max"] > 1e-2  # other experts, other log-probs


@pytest.mark.timeout(300)
def test_replay_closes_the_gap_of_a_bf16_rollout(tmp_path_factory):
    """A bf16 rollout against an fp32 trainer: their routers disagree on a few tokens' experts
    (about 2% of (token, layer) sets here), and replay takes those tokens' gaps away; what is
    left is the dtypes' rounding."""
    out = _run(tmp_path_factory, "bf16")
    print(
        f"bf16 rollout, fp32 trainer: gap without replay {out['gap_off']}, with "
        f"{out['gap_rollout']}; own routing agrees on {out['own_agreement']:.3f}"
    )
    assert out["trainer_used_recorded"]
    assert out["gap_rollout"]["max"] <= out["gap_off"]["max"]
    if out["own_agreement"] < 1.0:  # this machine's bf16 kernels flipped some experts
        assert out["gap_rollout"]["max"] < out["gap_off"]["max"]
        assert out["gap_rollout"]["mean"] < out["gap_off"]["mean"]


@pytest.mark.timeout(300)
def test_the_update_replays_and_the_router_learns(replay):
    assert replay["routers_moved"]
    assert replay["update_rollout"]["actor/grad_norm"] > 0


@pytest.mark.timeout(300)
def test_old_policy_replays_the_old_policy_pass(replay):
    assert replay["old_policy_rows"] >= 1
    assert replay["old_policy_attached_own"]
    assert replay["update_old_policy"]["actor/grad_norm"] > 0
    # Its own old-policy routing replayed: no rollout routing to compare with.
    assert "moe/routing_agreement" not in replay["update_old_policy"]


@pytest.mark.timeout(300)
def test_the_update_reports_the_rollouts_routing_against_its_own(replay):
    """moe/routing_agreement and moe/expert_load_max of an update replaying the rollout's
    routing, against the same figures computed from the trainer's own recorded routing."""
    first = replay["update_rollout"]
    assert first["moe/routing_agreement"] == pytest.approx(replay["own_agreement"])
    shifted = replay["update_shifted"]
    assert shifted["moe/routing_agreement"] == pytest.approx(replay["shifted_agreement"])
    assert shifted["moe/routing_agreement"] < first["moe/routing_agreement"]
    assert shifted["moe/expert_load_max"] == pytest.approx(replay["shifted_load_max"])
    assert shifted["moe/expert_load_max"] >= 1.0


@pytest.mark.parametrize(
    ("model", "errors"), [("preset:tiny-qwen2", 1), ("preset:tiny-qwen3-moe", 0)]
)
def test_validate_refuses_replay_on_a_dense_model(model, errors):
    from pathlib import Path

    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.loading.workflow import load_workflow

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    overrides = {"model_args.model_name_or_path": model, "algorithm.routing_replay": "rollout"}
    _, report = load_workflow(str(quickstart), create_plugin_host(), overrides)
    found = [e for e in report.errors if e.path == "algorithm.routing_replay"]
    assert len(found) == errors, report.errors
    if errors:
        assert "has none" in found[0].render()


@pytest.mark.timeout(120)
def test_old_policy_routing_is_pooled_over_ranks(tmp_path):
    from posttrain.testing.spawn import run_ranks

    run_ranks("routing_replay_workers:scenario_pool", 2, str(tmp_path), timeout=90.0)
    assert torch.load(tmp_path / "pool.pt") == [True, True]
