"""The GPU's fused Gumbel-max draw (a Triton kernel) samples the softmax of ``logits / T`` and
reports the temperature-1 log-probability of what it drew; a seed fixes its samples. Skipped
without a GPU.

Run on the GPU machine: ``python -m pytest -m gpu tests/hf_infer/test_gumbel_kernel_gpu.py``.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_softmax(temperature):
    """Likely tokens in different chunks of the vocabulary (the kernel reads 8192 a program)."""
    from posttrain_hf_infer.gumbel_kernel import gumbel_max

    logits = torch.full((20_000,), -30.0, device="cuda")
    likely = [0, 9_000, 17_000, 19_999]
    logits[likely] = torch.tensor([2.0, 1.0, 0.0, -1.0], device="cuda")
    draws = 40_000
    generator = torch.Generator(device="cuda").manual_seed(0)
    token, logp = gumbel_max(logits.expand(draws, -1).contiguous(), temperature, generator)
    frequencies = torch.bincount(token, minlength=len(logits)).double().cpu() / draws
    expected = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    # 40k draws: a frequency's standard error is at most 0.0025.
    assert frequencies[likely].tolist() == pytest.approx(expected[likely].tolist(), abs=0.01)
    assert frequencies[likely].sum() == pytest.approx(1.0, abs=1e-3)  # -30 is all but never drawn
    assert torch.allclose(logp, torch.log_softmax(logits, dim=-1)[token], atol=1e-5)


def test_a_vocabulary_of_many_blocks_in_bf16_and_its_seed():
    from posttrain_hf_infer.gumbel_kernel import gumbel_max

    logits = (torch.randn(64, 151_936, device="cuda") * 4).to(torch.bfloat16)
    first = gumbel_max(logits, 0.7, torch.Generator(device="cuda").manual_seed(3))
    again = gumbel_max(logits, 0.7, torch.Generator(device="cuda").manual_seed(3))
    other = gumbel_max(logits, 0.7, torch.Generator(device="cuda").manual_seed(4))
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other[0])
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, first[0][:, None])[:, 0]
    torch.testing.assert_close(first[1], expected, atol=1e-4, rtol=0)
