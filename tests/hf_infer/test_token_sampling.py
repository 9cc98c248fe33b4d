"""hf_infer's token sampling: the fused Gumbel-max draw of the compiled decode samples the
softmax of ``logits / T`` and reports the temperature-1 log-probability of what it drew."""

from __future__ import annotations

import pytest
import torch

from posttrain.protocol import SamplingParams
from posttrain_hf_infer.token_sampling import gumbel_choice, is_plain


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_choice_samples_the_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    draws = 40_000
    generator = torch.Generator().manual_seed(0)
    uniform = torch.rand((draws, len(logits)), generator=generator)
    token, logp = gumbel_choice(logits.expand(draws, -1), uniform, temperature)
    frequencies = torch.bincount(token, minlength=len(logits)).double() / draws
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    # 40k draws: a frequency's standard error is at most 0.0025.
    assert frequencies.tolist() == pytest.approx(expected.tolist(), abs=0.01)
    assert frequencies[-1] == 0
    assert torch.allclose(logp, torch.log_softmax(logits, dim=-1)[token], atol=1e-6)


def test_a_zero_uniform_never_picks_its_token():
    logits = torch.zeros(1, 3)
    token, _ = gumbel_choice(logits, torch.tensor([[0.0, 0.5, 0.9]]), 1.0)
    assert token.item() == 2


def test_only_plain_sampling_is_fused():
    assert is_plain(SamplingParams())
    assert is_plain(SamplingParams(temperature=0.7))
    assert not is_plain(SamplingParams(temperature=0.0))
    assert not is_plain(SamplingParams(top_k=5))
    assert not is_plain(SamplingParams(top_p=0.9))
