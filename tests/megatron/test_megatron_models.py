"""mbridge loading into the plugin's layer spec: logits equal HF's, export is a bitwise round trip.

Qwen2 at TP1 and TP2 (odd vocabulary: padded over TP ranks), Qwen3 (q/k norms), Llama, and
Qwen3-MoE with two expert-parallel ranks (allgather dispatcher on CPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = {
    "qwen2_tp1": ("qwen2", {}, 1),
    "qwen2_tp2": ("qwen2", {"tensor_model_parallel_size": 2}, 2),
    "qwen3_tp2": ("qwen3", {"tensor_model_parallel_size": 2}, 2),
    "llama_tp2": ("llama", {"tensor_model_parallel_size": 2}, 2),
    "qwen3_moe_ep2": (
        "qwen3_moe",
        {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"},
        2,
    ),
}


@pytest.fixture(scope="session")
def loaded(tmp_path_factory):
    from megatron_workers import build_hf_model, launch

    root = tmp_path_factory.mktemp("megatron-models")
    paths = {}
    for tag, (arch, layout, world) in CASES.items():
        if arch not in paths:
            paths[arch] = build_hf_model(str(root / arch), arch)
        launch("logits", world, str(root), model=paths[arch], tag=tag, layout=layout)
    return root, paths


@pytest.mark.parametrize("tag", sorted(CASES))
def test_logits_match_hf_and_export_round_trips(loaded, tag):
    import transformers
    from safetensors.torch import load_file

    root, paths = loaded
    path = paths[CASES[tag][0]]
    got = torch.load(root / f"{tag}.pt", weights_only=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=got["ids"]).logits
    assert (got["logits"] - ref).abs().max().item() < 1e-5
    saved = load_file(f"{path}/model.safetensors")
    assert got["exported"].keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(got["exported"][name], tensor), name
