"""A vision-language model (preset:tiny-qwen2-vl) in fsdp2_train with hf_infer as the rollout:
prompts with images processed once, rolled out, trained on (vision tower frozen), the whole
model synced in process; then the trainer's and the reference's log-probs of a new rollout's
samples are the rollout's (fp32), and they depend on the images."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from vision_workers import VLM

    from posttrain.tasks.presets import preset_path
    from posttrain.testing.spawn import run_ranks

    preset_path(VLM)  # built once, before the rank starts
    out = tmp_path_factory.mktemp("fsdp-vision")
    run_ranks("vision_workers:scenario_sync_parity", 1, str(out), timeout=240.0)
    found = torch.load(out / "vision_parity.pt", weights_only=False)
    found["hf"] = out / "hf"
    return found


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
    assert parity["grad_norm"] > 0
    assert parity["text_moved"]
    assert parity["vision_frozen"]
    assert not parity["vision_trainable"]
    assert parity["synced_vision"]


@pytest.mark.timeout(300)
def test_export_hf_loads_with_its_image_processor_and_the_same_logits(parity):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from posttrain.backend import model_inputs
    from posttrain.protocol import SequenceBatch

    model = AutoModelForImageTextToText.from_pretrained(parity["hf"], dtype=torch.float32)
    processor = AutoImageProcessor.from_pretrained(parity["hf"])
    assert processor.merge_size == 2 and processor.patch_size == 8
    probe = SequenceBatch(dict(parity["probe"]))
    with torch.no_grad():
        logits = model(
            **model_inputs(model, probe), attention_mask=probe.attention_mask, use_cache=False
        ).logits
    mask = probe.attention_mask.bool()
    assert (logits[mask] - parity["logits"][mask]).abs().max() < 1e-4
