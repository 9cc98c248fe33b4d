"""Stop strings (``generating_args.stop_strings``): where the text is cut, and hf_infer ends a
sample with the token that completes one, as vLLM does."""

from __future__ import annotations

from collections import Counter

import pytest

from posttrain.protocol import GenerationRequest, SamplingParams, stop_string_start
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import cut_after_stop_string
from posttrain_hf_infer.engine import HFInferState


@pytest.mark.parametrize(
    ("text", "stop", "start"),
    [
        ("7+8=15", ("=",), 3),
        ("7+8=15", ("8=", "+"), 1),  # "+" completes first
        ("abcd", ("cd", "bcd"), 2),  # both complete at the end: the earlier in the list wins
        ("abcd", ("bcd", "cd"), 1),
        ("abcd", ("x", "dc"), None),
        ("", ("a",), None),
    ],
)
def test_stop_string_start(text, stop, start):
    assert stop_string_start(text, stop) == start


def test_hf_infer_stops_with_the_token_completing_a_stop_string(hf_infer_worker):
    from posttrain_hf_infer import engine as hf_infer

    worker = hf_infer_worker
    tokenizer = worker.engine_state(HFInferState).tokenizer

    def generate(stop):
        sampling = SamplingParams(n=4, max_new_tokens=10, stop=stop)
        return hf_infer.generate(
            worker, GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3)
        )

    free = generate(())
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in free.response_ids]
    # The commonest two-character string (two tokens) of the free samples, and "*".
    pairs = Counter(
        t[i : i + 2] for t in texts for i in range(len(t) - 1) if "*" not in t[i : i + 2]
    )
    stop = (pairs.most_common(1)[0][0], "*")
    stopped = generate(stop)
    cut = by_pair = 0
    for i, (ids, logprobs) in enumerate(zip(free.response_ids, free.response_logprobs)):
        want_ids, want_logprobs = cut_after_stop_string(tokenizer, ids, logprobs, stop)
        assert stopped.response_ids[i] == want_ids
        assert stopped.response_logprobs[i] == pytest.approx(want_logprobs, abs=1e-6)
        cut += len(want_ids) < len(ids)
        by_pair += tokenizer.decode(want_ids, skip_special_tokens=True).endswith(stop[0])
    print(f"\nstop {stop}: {cut} of {len(texts)} samples cut, {by_pair} by {stop[0]!r}")
    assert cut >= 2 and by_pair >= 1


def test_hf_infer_ignore_eos_samples_the_full_length(hf_infer_worker):
    """``generating_args.ignore_eos`` (forced lengths, for benchmarks): every sample runs to
    max_new_tokens; without it some end at EOS, which the tiny model samples often."""
    from posttrain_hf_infer import engine as hf_infer

    eos = hf_infer_worker.engine_state(HFInferState).tokenizer.eos_token_id

    def lengths(ignore_eos: bool) -> tuple[list[int], list[list[int]]]:
        sampling = SamplingParams(n=8, max_new_tokens=12, ignore_eos=ignore_eos)
        out = hf_infer.generate(
            hf_infer_worker, GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=5)
        )
        return [len(r) for r in out.response_ids], out.response_ids

    forced, forced_ids = lengths(True)
    assert set(forced) == {12}
    free, free_ids = lengths(False)
    assert min(free) < 12 and all(r[-1] == eos for r in free_ids if len(r) < 12)
    assert any(eos in r[:-1] for r in forced_ids)  # EOS sampled, and sampling went on
