"""Test-only plugin, loaded through a workflow's ``plugins:`` list: every training step reports
what it trained on as two figures, so that two runs can be compared sample for sample from
their metrics alone.

``actor/data_prompts_digest``: the sum over the step's samples of a CRC-32 of each sample's
prompt tokens; ``actor/data_samples_digest``: the same over prompt and response. Sums do not
depend on the order of the samples or on how ranks split them (the driver adds the ranks'
shares), and a sample lost or trained twice changes them. ``actor/data_samples``: how many.
Each CRC is taken modulo 2**20, so that the sums stay exact in a float.
"""

from __future__ import annotations

import zlib

import torch

from posttrain import hookimpl


@hookimpl(wrapper=True)
def posttrain_train_step(worker, batch, loss_fn):
    metrics = yield
    if metrics is None or worker.role != "actor_train":
        return metrics
    return {**metrics, **digests(batch)}


def digests(batch) -> dict[str, float]:
    prompts = samples = 0
    for ids, attended, response in zip(
        batch["input_ids"], batch["attention_mask"], batch["response_mask"], strict=True
    ):
        before_response = torch.cumsum(response, 0) == 0
        prompts += _crc(ids[attended.bool() & before_response])
        samples += _crc(ids[attended.bool()])
    return {
        "actor/data_prompts_digest": float(prompts),
        "actor/data_samples_digest": float(samples),
        "actor/data_samples": float(len(batch["input_ids"])),
    }


def _crc(tokens: torch.Tensor) -> int:
    return zlib.crc32(tokens.to(torch.int64).numpy().tobytes()) % (1 << 20)
