"""Weights written shard by shard load back exactly, with transformers' file layout."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from posttrain.backends.safetensors_shards import write_shards


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(5)}


def test_shards_fill_up_to_the_limit_and_load_back_exactly(tmp_path):
    tensors = _tensors()
    written = write_shards(iter(tensors.items()), str(tmp_path), max_shard_bytes=2 * 64 * 64 * 4)
    assert written == 5 * 64 * 64 * 4
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == written
    loaded = {}
    for name in files:
        loaded.update(load_file(str(tmp_path / name)))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".shard-*"))


def test_one_shard_is_model_safetensors(tmp_path):
    tensors = _tensors()
    tied = {**tensors, "lm_head.weight": tensors["model.layers.0.weight"]}  # shared storage
    write_shards(iter(tied.items()), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tied.items())
