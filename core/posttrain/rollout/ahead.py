"""The batches an asynchronous run produced ahead of a checkpoint's step, as the checkpoint's
driver state holds them (JSON): everything the resumed run trains on and logs from them, exact
(a float is written as Python's shortest repr, which reads back to the same float)."""

from __future__ import annotations

from typing import Any

import attrs

from posttrain.protocol import (
    RolloutSamples,
    images_from_record,
    images_record,
    routing_from_record,
    routing_record,
)
from posttrain.rollout.batches import ProducedBatch
from posttrain.rollout.groups import ScoredGroups
from posttrain.tasks.data import Prompt


def batch_record(batch: ProducedBatch) -> dict[str, Any]:
    scored = batch.scored
    return {
        "index": batch.index,
        "policy_version": batch.policy_version,
        "sampler_state": batch.sampler_state,
        "sampling_metrics": batch.sampling_metrics,
        "timings": batch.timings,
        "rank_stats": batch.rank_stats,
        "prompts": [
            attrs.asdict(p, filter=lambda field, _: field.name != "images") for p in scored.prompts
        ],
        # Vision-language prompts' images (tensors) as base64; None: no prompt has one.
        "prompt_images": (
            images_record([p.images for p in scored.prompts])
            if any(p.images for p in scored.prompts)
            else None
        ),
        "samples": _samples_record(scored.samples),
        "rewards": scored.rewards.tolist(),
        "rewards_dtype": str(scored.rewards.dtype).removeprefix("torch."),
        "reward_metrics": scored.reward_metrics,
        "turn_rewards": scored.turn_rewards,
    }


def batch_from_record(record: dict[str, Any]) -> ProducedBatch:
    import torch

    shown = record.get("prompt_images")
    images = images_from_record(shown) if shown else [None] * len(record["prompts"])
    prompts = [
        Prompt(**{**p, "ids": tuple(p["ids"])}, images=image)
        for p, image in zip(record["prompts"], images)
    ]
    scored = ScoredGroups(
        prompts=prompts,
        samples=_samples_from_record(record["samples"]),
        rewards=torch.tensor(record["rewards"], dtype=getattr(torch, record["rewards_dtype"])),
        reward_metrics=record["reward_metrics"],
        turn_rewards=record["turn_rewards"],
    )
    return ProducedBatch(
        index=record["index"],
        scored=scored,
        sampling_metrics=record["sampling_metrics"],
        sampler_state=record["sampler_state"],
        policy_version=record["policy_version"],
        timings=record["timings"],
        rank_stats=record["rank_stats"],
    )


def _samples_record(samples: RolloutSamples) -> dict[str, Any]:
    """The samples as JSON values; their routing (tensors, MoE routing replay) and images
    (vision-language models) as base64."""
    record = attrs.asdict(samples, filter=lambda field, _: field.name not in TENSOR_FIELDS)
    if samples.routing is not None:
        record["routing"] = routing_record(samples.routing)
    if samples.images is not None:
        record["images"] = images_record(samples.images)
    return record


def _samples_from_record(record: dict[str, Any]) -> RolloutSamples:
    routing, images = record.get("routing"), record.get("images")
    fields = {k: v for k, v in record.items() if k not in TENSOR_FIELDS}
    return RolloutSamples(
        **fields,
        routing=None if routing is None else routing_from_record(routing),
        images=None if images is None else images_from_record(images),
    )


# RolloutSamples' fields of tensors, written as base64.
TENSOR_FIELDS = ("routing", "images")
