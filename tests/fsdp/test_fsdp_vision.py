"""A vision-language model (preset:tiny-qwen2-vl) in fsdp2_train with hf_infer as the rollout:
prompts with images processed once, rolled out, trained on (vision tower frozen), the whole
model synced in process; then the trainer's and the reference's log-probs of a new rollout's
samples are the rollout's (fp32), and they depend on the images (the scenario is
tests/vision_workers.py's, which deepspeed_train runs too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from vision_workers import run_scenario

    return run_scenario(tmp_path_factory.mktemp("fsdp-vision"), "fsdp2_train")


@pytest.mark.timeout(300)
def test_rollout_and_trainer_log_probs_agree_after_a_sync(parity):
    gaps = {k: v for k, v in parity.items() if "gap" in k}
    print(f"VLM rollout-vs-trainer gap (fp32): {gaps}")
    assert parity["rows"] == 8 and parity["patches"] == (8, 16, 384)
    assert parity["gap"] < 1e-5
    assert parity["reference_gap"] < 1e-5
    assert parity["blind_gap"] > 1e-2  # the images count


@pytest.mark.timeout(300)
def test_the_vision_tower_stays_frozen_and_syncs(parity):
    from vision_workers import check_frozen_tower

    check_frozen_tower(parity)


@pytest.mark.timeout(300)
def test_export_hf_loads_with_its_image_processor_and_the_same_logits(parity):
    from vision_workers import check_export

    check_export(parity)
