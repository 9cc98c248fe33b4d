"""FSDP2 numerics on 2 gloo ranks: DP equivalence, dynamic micro-batches, DCP resume."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def load(directory, name):
    return torch.load(directory / name, weights_only=False)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_bitwise(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_two_ranks_match_one_rank(single_run, dp2_run):
    one = load(single_run, "params_w1.pt")
    two = load(dp2_run, "params_w2.pt")
    initial = load(dp2_run, "params_at_save.pt")
    diff = max_abs_diff(one, two)
    print(f"max |w(2 ranks) - w(1 rank)| after 3 steps: {diff:.3e}")
    assert diff < 1e-5
    # The model did train.
    assert max_abs_diff(two, initial) > 1e-4

    m1 = load(single_run, "metrics_w1.pt")[0]
    m2 = load(dp2_run, "metrics_w2.pt")
    for step in range(3):
        for key, value in m1[step].items():
            if key.endswith(("grad_norm", "lr")):
                # Identical on every rank.
                assert m2[0][step][key] == m2[1][step][key]
                assert m2[0][step][key] == pytest.approx(value, rel=1e-5, abs=1e-7)
            else:
                # Shares of global means: they sum over ranks.
                assert m2[0][step][key] + m2[1][step][key] == pytest.approx(value, abs=1e-5)
        assert isinstance(m2[0][step]["actor/pg_loss"], float)


def test_dynamic_micro_batches_match_fixed(single_run, dp2_run):
    fixed = load(dp2_run, "params_w2.pt")
    dynamic = load(dp2_run, "params_dynamic.pt")
    diff = max_abs_diff(fixed, dynamic)
    print(f"max |w(dynamic) - w(fixed)|: {diff:.3e}")
    assert diff < 1e-5

    plans = load(dp2_run, "dynamic_plans.pt")  # [rank][step] -> (groups, count)
    for step in range(3):
        counts = {plans[r][step][1] for r in range(2)}
        assert len(counts) == 1  # every rank runs the same number of passes
    assert any(len(plans[r][s][0]) != 2 for r in range(2) for s in range(3))

    # Uneven shares (7 rows and 1 row): the small rank runs zero-weight micro-batches.
    uneven = load(dp2_run, "params_uneven.pt")
    diff = max_abs_diff(load(single_run, "params_w1.pt"), uneven)
    print(f"max |w(uneven shares) - w(1 rank)|: {diff:.3e}")
    assert diff < 1e-5


def test_dcp_checkpoint_round_trip_is_bit_exact(resume_run):
    assert load(resume_run, "layout.pt") == {"format": "torch_dcp", "dp_size": 2}
    assert_bitwise(load(resume_run, "params_at_save.pt"), load(resume_run, "params_loaded.pt"))
    saved_optim = load(resume_run, "optim_at_save.pt")
    loaded_optim = load(resume_run, "optim_loaded.pt")
    assert saved_optim["state"]
    assert_bitwise(saved_optim["state"], loaded_optim["state"])
    for g_saved, g_loaded in zip(saved_optim["param_groups"], loaded_optim["param_groups"]):
        assert g_saved == g_loaded
    # The step after resuming equals the uninterrupted run's third step, bit for bit.
    assert_bitwise(load(resume_run, "params_w2.pt"), load(resume_run, "params_resumed.pt"))


def test_fsdp2_infer_logprobs_match_hf(resume_run):
    from fsdp_workers import probe_batch
    from transformers import AutoModelForCausalLM

    from posttrain.backends.models import resolve_model_path
    from posttrain.scoring.modeling import shifted_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("preset:tiny-qwen2")).eval()
    batch = probe_batch(model.config.vocab_size).split(2)[0]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = shifted_token_logprobs(logits, batch.input_ids) * batch.attention_mask
    got = load(resume_run, "ref_logprobs_rank0.pt")
    assert got.shape == batch.input_ids.shape and got.dtype == torch.float32
    assert float((got - expected).abs().max()) < 1e-5


def test_chunked_logprobs_match_full_logits(dp2_run):
    """logprob_chunk_tokens 7 (several chunks per micro-batch, through the sharded model's own
    forward) gives the full logits' old log-probs, and the same train step."""
    runs = load(dp2_run, "chunked.pt")
    full, chunked = runs[0], runs[7]
    assert full["head_calls"] == 0
    assert chunked["head_calls"] > 0 and chunked["head_rows"] > 7 * chunked["head_calls"] / 2
    diff = float((chunked["logprobs"] - full["logprobs"]).abs().max())
    print(f"max |logprobs(chunk 7) - logprobs(full)|: {diff:.3e}")
    assert diff < 1e-5
    assert full["metrics"].keys() == chunked["metrics"].keys()
    for key, value in full["metrics"].items():
        assert chunked["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
