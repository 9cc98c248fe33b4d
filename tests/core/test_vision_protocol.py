"""Images travel with the samples (vision-language models): RolloutSamples and SequenceBatch
keep each row's ImageInputs through select, concat, trimming and micro-batches; a batch made
ahead keeps them bitwise through a checkpoint's JSON; the forward's inputs feed a sampled
image placeholder as the rollout fed it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import torch

from posttrain.protocol import (
    ImageInputs,
    RolloutSamples,
    SequenceBatch,
    build_sequence_batch,
    image_forward_inputs,
)
from posttrain.rollout.ahead import batch_from_record, batch_record
from posttrain.rollout.batches import ProducedBatch
from posttrain.rollout.groups import ScoredGroups
from posttrain.tasks.data import Prompt

IMAGE, END = 9, 8  # image placeholder and vision-end token ids
CONFIG = SimpleNamespace(
    image_token_id=IMAGE,
    vision_end_token_id=END,
    vision_config=SimpleNamespace(spatial_merge_size=2),
)


def _image(seed: int, images: int = 1) -> ImageInputs:
    g = torch.Generator().manual_seed(seed)
    return ImageInputs(
        pixel_values=torch.randn(16 * images, 6, generator=g),
        image_grid_thw=torch.tensor([[1, 4, 4]] * images),
    )


def test_samples_and_batches_keep_each_rows_images():
    a, b = _image(1), _image(2, images=2)
    left = RolloutSamples(
        prompt_ids=[[1, *[IMAGE] * 4]], response_ids=[[3, 4]], response_logprobs=[[-1.0, -2.0]]
    )
    left.images = [a]
    right = RolloutSamples(
        prompt_ids=[[1, *[IMAGE] * 8, 2]], response_ids=[[5]], response_logprobs=[[-0.5]]
    )
    right.images = [b]
    samples = RolloutSamples.concat([left, right]).select([1, 0])
    assert samples.images == [b, a]
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        0,
        samples.response_logprobs,
        images=samples.images,
    )
    assert batch["pixel_values"].shape == (2, 32, 6)
    assert batch["image_grid_thw"].shape == (2, 2, 3)
    # A micro-batch of the shorter row: trimmed on tokens, its images whole.
    micro = batch.select([1]).trimmed()
    assert micro.input_ids.shape[1] == 7 and micro["pixel_values"].shape == (1, 32, 6)
    inputs = image_forward_inputs(
        micro.input_ids, micro["pixel_values"], micro["image_grid_thw"], CONFIG
    )
    assert torch.equal(inputs["pixel_values"], a.pixel_values)
    assert torch.equal(inputs["image_grid_thw"], a.image_grid_thw)
    both = SequenceBatch.concat([batch.select([0]).trimmed(), micro])
    assert torch.equal(both["pixel_values"], batch["pixel_values"])
    inputs = image_forward_inputs(
        both.input_ids, both["pixel_values"], both["image_grid_thw"], CONFIG
    )
    assert torch.equal(inputs["pixel_values"], torch.cat([b.pixel_values, a.pixel_values]))
    assert inputs["mm_token_type_ids"].sum() == 12


def test_a_sampled_placeholder_is_fed_as_vision_end():
    ids = torch.tensor([[1, *[IMAGE] * 4, 2, IMAGE]])  # the last one was sampled
    image = _image(3)
    inputs = image_forward_inputs(ids, image.pixel_values[None], image.image_grid_thw[None], CONFIG)
    assert inputs["input_ids"].tolist() == [[1, *[IMAGE] * 4, 2, END]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 1, 0, 0]]


def test_a_batch_made_ahead_keeps_its_images_bitwise():
    image = _image(4)
    samples = RolloutSamples(
        prompt_ids=[[1, 2], [1, 2], [3]],
        response_ids=[[3], [4], [5]],
        response_logprobs=[[-0.1], [-0.2], [-0.3]],
        images=[image, image, None],
    )
    scored = ScoredGroups(
        prompts=[
            Prompt(text="a", answer="1", ids=(1, 2), images=image),
            Prompt(text="b", answer="2", ids=(3,)),
        ],
        samples=samples,
        rewards=torch.tensor([0.0, 1.0, 0.5]),
        reward_metrics={},
    )
    batch = ProducedBatch(4, scored, {}, {"position": 4}, 2)
    back = batch_from_record(json.loads(json.dumps(batch_record(batch))))
    got = back.scored.samples.images
    assert got is not None and got[2] is None
    for sent, kept in zip([image, image], got[:2]):
        assert kept is not None
        assert torch.equal(kept.pixel_values, sent.pixel_values)
        assert torch.equal(kept.image_grid_thw, sent.image_grid_thw)
    first, second = back.scored.prompts
    assert first.images is not None and torch.equal(first.images.pixel_values, image.pixel_values)
    assert second.images is None
    assert attrs.evolve(back.scored.samples, images=None) == attrs.evolve(samples, images=None)
