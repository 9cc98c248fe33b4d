"""Weight export (sync buckets) and HF export of an FSDP2-trained model."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def load(directory, name):
    return torch.load(directory / name, weights_only=False)


def test_export_weights_matches_trained_state_and_hf_export(dp2_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.backends.models import resolve_model_path
    from posttrain.config.sections import ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import WeightBucket, fused_group
    from posttrain_hf_infer import engine as hf_infer

    export = load(dp2_run, "export.pt")
    buckets = export["buckets"]
    counts = export["counts_per_rank"]
    assert len(buckets) > 2
    # Rank 1 yields the same number of buckets, all empty.
    assert len(counts[0]) == len(counts[1]) == len(buckets)
    assert all(n == 0 for n in counts[1]) and all(n > 0 for n in counts[0])

    exported = {name: t for bucket in buckets for name, t in bucket}
    trained = load(dp2_run, "params_w2.pt")
    assert exported.keys() == trained.keys()
    assert "lm_head.weight" in exported
    for name, tensor in exported.items():
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, trained[name]), name

    # A fused group (q/k/v of one layer, gate/up of one MLP) never spans two buckets.
    where: dict[str, set[int]] = {}
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            where.setdefault(fused_group(name), set()).add(i)
    fused = {k: v for k, v in where.items() if k.endswith((".self_attn", ".mlp"))}
    assert len(fused) == 4  # 2 layers x (attention, MLP)
    assert all(len(v) == 1 for v in fused.values())
    qkv = {i for i, b in enumerate(buckets) for n, _ in b if "layers.0.self_attn." in n}
    assert len(qkv) == 1

    # Same tensors as export_hf's safetensors (which drops the tied head, as HF does).
    saved = load_file(str(dp2_run / "hf" / "model.safetensors"))
    assert set(saved) == set(exported) - {"lm_head.weight"}
    for name, tensor in saved.items():
        assert torch.equal(tensor, exported[name]), name

    # hf_infer's import accepts every exported name, and the result is the trained model.
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("preset:tiny-qwen2"))
    ctx = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=None,
        model_args=ModelArgs(model_name_or_path="preset:tiny-qwen2"),
        model=model,
    )
    hf_infer.import_weights(ctx, [WeightBucket(list(b)) for b in buckets])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_export_hf_loads_and_matches_trained_logits(dp2_run):
    from fsdp_workers import probe_batch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.scoring.modeling import shifted_token_logprobs

    path = dp2_run / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert AutoTokenizer.from_pretrained(str(path)) is not None

    probe = load(dp2_run, "probe.pt")
    batch = probe_batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    diff = float((logits - probe["logits"]).abs().max())
    print(f"max |logits(HF export) - logits(FSDP2)|: {diff:.3e}")
    assert diff < 1e-6

    # compute_logprobs (zero where attention_mask is 0) agrees with the HF model.
    expected = shifted_token_logprobs(logits, batch.input_ids) * batch.attention_mask
    assert probe["logprobs"].dtype == torch.float32
    assert probe["logprobs"].shape == batch.input_ids.shape
    assert float((probe["logprobs"] - expected).abs().max()) < 1e-5
    assert bool((probe["logprobs"][batch.attention_mask == 0] == 0).all())
