"""hf_infer's fixed-shape decode (``strategy_config.decode: static``; ``cuda_graph`` runs the same
step captured in a CUDA graph): the same samples and log-probs as the dynamic cache, a decoder
reused across generations and shape buckets, and the conformance kit in that mode."""

from __future__ import annotations

import attrs
import pytest
import torch

from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing import StrategyContract
from posttrain.testing.batches import PROMPTS


class TestHFInferStaticDecodeContract(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "static"}
    supports_checkpoint = False  # no decoding in it: test_hf_infer_contract.py runs it


def generate(worker, decode: str, prompts, sampling, seed: int):
    from posttrain_hf_infer import engine as hf_infer

    worker.config = attrs.evolve(worker.config, decode=decode)
    return hf_infer.generate(
        worker, GenerationRequest(prompt_ids=prompts, sampling=sampling, seed=seed)
    )


def decoders(worker):
    """The rank's kept fixed-shape decoders."""
    from posttrain_hf_infer.engine import HFInferState

    return worker.engine_state(HFInferState).decoders


def assert_a_forward_pass_scores(worker, out) -> None:
    """Every sample's log-probs are what a forward pass over its prompt and response gives."""
    from posttrain.testing.expected import forward_logprob_gap

    assert forward_logprob_gap(worker.model, out) <= 1e-4


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]


def test_static_decode_samples_what_the_dynamic_cache_samples(hf_infer_settings, monkeypatch):
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer import static_decode

    # Windows of 4 slots: the prefill and the steps attend to 2 or 3 growing windows, not to
    # the whole cache of 128 (the GPU's 128-slot windows are the same code at a larger size).
    monkeypatch.setattr(static_decode, "WINDOW_BUCKET", 4)
    with hf_infer_settings() as worker:
        # 3 prompts x 3 samples: 9 rows in a decoder of 16; prompts of different lengths.
        sampling = SamplingParams(n=3, max_new_tokens=7)
        dynamic = generate(worker, "dynamic", PROMPTS[:3], sampling, seed=4)
        static = generate(worker, "static", PROMPTS[:3], sampling, seed=4)
        # Again on the kept decoder (its cache emptied), then in a second shape bucket.
        again = generate(worker, "static", PROMPTS[:3], sampling, seed=4)
        fewer = attrs.evolve(sampling, n=2)
        other = generate(worker, "static", PROMPTS[1:3], fewer, seed=9)
        other_dynamic = generate(worker, "dynamic", PROMPTS[1:3], fewer, seed=9)
        assert sorted(decoders(worker)._decoders) == [(8, 128), (16, 128)]
    for a, b in ((dynamic, static), (static, again), (other_dynamic, other)):
        assert a.response_ids == b.response_ids
        for x, y in zip(a.response_logprobs, b.response_logprobs):
            assert x == pytest.approx(y, abs=1e-5)
    assert hf_infer.decode_mode(worker) == "dynamic"  # auto, on the CPU


@pytest.mark.parametrize(
    "decode, settings",
    [
        ("static", "hf_infer_settings"),
        pytest.param("compiled", "hf_infer_cuda_settings", marks=ON_GPU, id="compiled-cuda"),
    ],
)
def test_one_token_prompts_on_a_reused_decoder(request, decode, settings):
    """A prefill one token wide writes its keys at the rows' query slots, as a step does: those
    are set before it (after it, they were the last generation's, and the prompts' keys went
    there). On a GPU: the compiled step in its CUDA graphs."""
    sampling = SamplingParams(n=2, max_new_tokens=5)
    with request.getfixturevalue(settings)() as worker:
        generate(worker, decode, [[1, 5, 9, 4, 7]], sampling, seed=1)  # query slots at 8
        out = generate(worker, decode, [[5], [9]], sampling, seed=3)
        assert_a_forward_pass_scores(worker, out)


def test_batches_of_sorted_prompts_come_back_in_the_request_order(hf_infer_settings):
    """Prompts of mixed lengths over several batches are decoded shortest first; each sample
    is still its own prompt's, as when that prompt is generated alone (greedy)."""
    prompts = [[1, 7, 14, 8, 17, 5, 14], [1, 5, 14], [1, 13, 14, 4, 17], [1, 4, 14, 4]]
    sampling = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
    with hf_infer_settings(batch_size=2) as worker:
        together = generate(worker, "dynamic", prompts, sampling, seed=1)
        alone = [generate(worker, "dynamic", [p], sampling, seed=1) for p in prompts]
    assert together.prompt_ids == prompts
    for i, single in enumerate(alone):
        assert together.response_ids[i] == single.response_ids[0]
        assert together.response_logprobs[i] == pytest.approx(single.response_logprobs[0], abs=1e-5)


def test_fused_and_separate_projections_decode_alike(hf_infer_settings):
    """``fuse_projections`` (on by default) stacks each layer's q/k/v and gate/up; off, the
    same samples come from one GEMM per projection."""
    sampling = SamplingParams(n=2, max_new_tokens=6)
    with hf_infer_settings() as worker:
        fused = generate(worker, "static", PROMPTS[:2], sampling, seed=3)
        config = worker.model.config
        gate_up = [[config.intermediate_size] * 2] * config.num_hidden_layers
        assert [g.sizes for g in decoders(worker).groups][1::2] == gate_up
    with hf_infer_settings(fuse_projections=False) as worker:
        separate = generate(worker, "static", PROMPTS[:2], sampling, seed=3)
        assert decoders(worker).groups == []
    assert fused.response_ids == separate.response_ids
    for x, y in zip(fused.response_logprobs, separate.response_logprobs):
        assert x == pytest.approx(y, abs=1e-5)


def test_a_gpu_kernel_asked_for_on_the_cpu_leaves_grouped_sdpa(hf_infer_settings):
    """``decode_attention: triton`` (or cudnn) where the kernel does not serve (here: no GPU)
    decodes with grouped SDPA, the same samples as the default."""
    from posttrain_hf_infer import static_decode

    sampling = SamplingParams(n=2, max_new_tokens=4)
    with hf_infer_settings() as worker:
        default = generate(worker, "static", PROMPTS[:1], sampling, seed=2)
    for kernel in ("triton", "cudnn"):
        with hf_infer_settings(decode_attention=kernel) as worker:
            asked = generate(worker, "static", PROMPTS[:1], sampling, seed=2)
            (decoder,) = decoders(worker)._decoders.values()
        assert decoder.attention == static_decode.ATTENTION
        assert asked.response_ids == default.response_ids


class TestHFInferCompiledDecodeContract(StrategyContract):
    strategy = "hf_infer"
    strategy_config = {"decode": "compiled"}
    supports_checkpoint = False  # no decoding in it: test_hf_infer_contract.py runs it


def test_compiled_decode_decodes_what_the_static_decode_decodes(hf_infer_settings, monkeypatch):
    """Greedy, so the compiled mode's fused sampling is not in play (the kit above checks its
    log-probs): the compiled step gives the eager step's tokens and log-probs across windows."""
    from posttrain_hf_infer import static_decode

    monkeypatch.setattr(static_decode, "WINDOW_BUCKET", 4)
    sampling = SamplingParams(n=2, max_new_tokens=9, temperature=0.0)
    with hf_infer_settings() as worker:
        static = generate(worker, "static", PROMPTS[:3], sampling, seed=1)
        compiled = generate(worker, "compiled", PROMPTS[:3], sampling, seed=1)
    assert compiled.response_ids == static.response_ids
    for x, y in zip(compiled.response_logprobs, static.response_logprobs):
        assert x == pytest.approx(y, abs=1e-5)


def test_a_step_that_does_not_compile_runs_uncompiled(hf_infer_settings, monkeypatch, caplog):
    from posttrain_hf_infer import static_decode

    def untraceable(*args):
        raise torch._dynamo.exc.Unsupported("a model torch.compile cannot trace")

    monkeypatch.setattr(static_decode, "compiled_forward", lambda: untraceable)
    sampling = SamplingParams(n=1, max_new_tokens=5, temperature=0.0)
    with hf_infer_settings() as worker:
        static = generate(worker, "static", PROMPTS[:2], sampling, seed=1)
        fallback = generate(worker, "compiled", PROMPTS[:2], sampling, seed=1)
    assert "does not compile" in caplog.text
    assert fallback.response_ids == static.response_ids
    assert fallback.response_logprobs == static.response_logprobs


@pytest.mark.parametrize(
    "decode, settings",
    [
        ("static", "hf_infer_settings"),
        ("compiled", "hf_infer_settings"),
        pytest.param("compiled", "hf_infer_cuda_settings", marks=ON_GPU, id="compiled-cuda"),
    ],
)
def test_refilled_rows_score_what_a_forward_pass_scores(request, monkeypatch, decode, settings):
    """Three rows for six prompts, the host looking every 3 steps: rows that ended stand still
    until a look collects them, two are refilled at once (prompts of different lengths, left-
    padded), and a refilled row decodes at other slots than its neighbours (its own windows,
    stale keys of the row's last sample past its slot). Greedy; the tiny model repeats a
    prompt's last token, so with 2 a stop token a sample ends after 1 or 12 tokens. Every
    sample's log-probs are what a forward pass over its prompt and response gives, and the
    samples are those of batches of rows run to their end (on a GPU: the compiled step in its
    CUDA graphs)."""
    from posttrain_hf_infer import decode_loop, static_decode

    monkeypatch.setattr(static_decode, "WINDOW_BUCKET", 4)
    monkeypatch.setattr(decode_loop, "look_interval", lambda device, sampling: 3)
    refills = []
    refill = decode_loop.StaticDecode.refill

    def counted(self, rows, prompts):
        refills.append(prompts)
        return refill(self, rows, prompts)

    monkeypatch.setattr(decode_loop.StaticDecode, "refill", counted)
    ends = [[1, 18, 10, 3, 2], [1, 5, 17, 12, 8, 9, 2]]
    runs = [[1, 14, 15], [1, 7, 5, 17, 8, 3, 2, 15], [1, 6, 10, 12, 12, 13, 4, 12, 3, 3, 10]]
    last = [1, 12, 7, 6, 16, 13, 18, 14, 18, 18, 3, 4, 18]
    prompts = [*ends, *runs, last]
    sampling = SamplingParams(
        n=1, max_new_tokens=12, temperature=0.0, stop_token_ids=(2,), ignore_eos=True
    )
    with request.getfixturevalue(settings)(batch_size=3) as worker:
        # Rows 6 (the first two end), 9 (the third, 3 steps on); refilled with widths 11 at
        # slot 10 (both) and, once the third ends, 13 at slot 12 while the others are at 19.
        out = generate(worker, decode, prompts, sampling, seed=3)
        worker.config = attrs.evolve(worker.config, continuous_batching=False)
        batched = generate(worker, decode, prompts, sampling, seed=3)
        assert_a_forward_pass_scores(worker, out)
    assert refills == [runs[1:], [last]]
    assert [len(r) for r in out.response_ids] == [1, 1, 12, 12, 12, 12]
    assert out.response_ids == batched.response_ids
    for x, y in zip(out.response_logprobs, batched.response_logprobs):
        assert x == pytest.approx(y, abs=1e-5)


def test_an_empty_share_decodes_nothing(hf_infer_settings):
    """A rank's share of a small batch can be empty: no prompts, no samples, in every mode."""
    sampling = SamplingParams(n=2, max_new_tokens=4)
    with hf_infer_settings() as worker:
        for decode in ("dynamic", "static"):
            out = generate(worker, decode, [], sampling, seed=1)
            assert (out.prompt_ids, out.response_ids, out.response_logprobs) == ([], [], [])
