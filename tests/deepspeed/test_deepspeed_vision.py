"""A vision-language model (preset:tiny-qwen2-vl) in deepspeed_train (ZeRO-2) with hf_infer as the
rollout, through the scenario fsdp2_train runs (tests/vision_workers.py; test_fsdp_vision.py has
the fuller account): a step with the vision tower frozen, a whole-model sync, the trainer's
log-probs of a new rollout's samples are the rollout's (fp32) and depend on the images, and the
export-hf loads with its image processor. A deepspeed_infer reference (ZeRO-3, built
partitioned) scores the first rollout as the rollout did."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from vision_workers import run_scenario

    return run_scenario(tmp_path_factory.mktemp("deepspeed-vision"), "deepspeed_train")


@pytest.mark.timeout(300)
def test_deepspeed_log_probs_agree_with_the_rollout_after_a_sync(parity):
    assert parity["rows"] == 8 and parity["patches"] == (8, 16, 384)
    assert parity["gap"] < 1e-5
    assert parity["reference_gap"] < 1e-5
    assert parity["initial_reference_gap"] < 1e-5  # deepspeed_infer, before the update
    assert parity["blind_gap"] > 1e-2  # the images count


@pytest.mark.timeout(300)
def test_deepspeed_keeps_the_vision_tower_frozen_and_syncs_it(parity):
    from vision_workers import check_frozen_tower

    check_frozen_tower(parity)


@pytest.mark.timeout(300)
def test_deepspeed_export_hf_loads_with_its_image_processor(parity):
    from vision_workers import check_export

    check_export(parity)
