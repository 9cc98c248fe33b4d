"""Routing replay in deepspeed_train (algorithm.routing_replay), through the helpers it shares
with fsdp2_train (tests/fsdp/test_fsdp_routing_replay.py has the fuller account): after a sync to
hf_infer, the trainer replays the rollout's experts in scoring and in the update, and
old_policy replays the old-policy pass's."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    from routing_replay_workers import MOE

    from posttrain.tasks.presets import preset_path
    from posttrain.testing.spawn import run_ranks

    preset_path(MOE)  # built once, before the rank starts
    out = tmp_path_factory.mktemp("deepspeed-routing")
    run_ranks(
        "routing_replay_workers:scenario_replay",
        1,
        str(out),
        timeout=240.0,
        trainer="deepspeed_train",
    )
    return torch.load(out / "replay_deepspeed_train_fp32.pt", weights_only=False)


@pytest.mark.timeout(300)
def test_deepspeed_replays_the_rollouts_experts(replay):
    assert replay["trainer_used_recorded"]
    assert replay["gap_rollout"]["max"] < 1e-5
    assert replay["gap_shifted"]["max"] > 1e-2
    assert replay["routers_moved"]
    assert replay["old_policy_attached_own"]
    assert replay["update_old_policy"]["actor/grad_norm"] > 0
