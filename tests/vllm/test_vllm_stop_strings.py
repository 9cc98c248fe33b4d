"""Stop strings on vLLM: a sample ends with the token that completes one (vLLM keeps it and
its log-prob), exactly where hf_infer ends it."""

from __future__ import annotations

from collections import Counter

import pytest

from posttrain.config.sections import (
    GeneratingArgs,
    ModelArgs,
)
from posttrain.errors import UserError
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import GenerationRequest, RolloutSamples, SamplingParams
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import (
    cut_after_stop_string,
    max_sample_logprob_diff,
    reference_logprobs,
    samples_batch,
)
from posttrain.testing.groups import group_spec


def _vllm_spec(model_path, tmp_path, stop_strings):
    return group_spec(
        "vllm",
        {},
        1,
        "actor_infer",
        model_path,
        tmp_path / "run",
        base_dir=tmp_path,
        generating=GeneratingArgs(stop_strings=stop_strings),
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vllm_stops_with_the_token_completing_a_stop_string(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=120)
    try:
        # Stop strings in the role's generating_args give the engine a tokenizer.
        group = launcher.start_group(_vllm_spec(tiny_model_path, tmp_path, ["*"]))

        def generate(stop):
            sampling = SamplingParams(n=4, max_new_tokens=10, stop=stop)
            request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3)
            return RolloutSamples.concat(group.call_dp("generate", [request]))

        free = generate(())
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in free.response_ids]
        # The commonest two-character string (two tokens) of the free samples, and "*".
        pairs = Counter(
            t[i : i + 2] for t in texts for i in range(len(t) - 1) if "*" not in t[i : i + 2]
        )
        stop = (pairs.most_common(1)[0][0], "*")
        stopped = generate(stop)
    finally:
        launcher.shutdown()
    cut = by_pair = 0
    for i, (ids, logprobs) in enumerate(zip(free.response_ids, free.response_logprobs)):
        want_ids, want_logprobs = cut_after_stop_string(tokenizer, ids, logprobs, stop)
        assert stopped.response_ids[i] == want_ids
        assert stopped.response_logprobs[i] == pytest.approx(want_logprobs, abs=1e-6)
        cut += len(want_ids) < len(ids)
        by_pair += tokenizer.decode(want_ids, skip_special_tokens=True).endswith(stop[0])
    print(f"\nvllm stop {stop}: {cut} of {len(texts)} samples cut, {by_pair} by {stop[0]!r}")
    assert cut >= 2 and by_pair >= 1
    # The kept log-probs are still those of the model's own distribution.
    ref = reference_logprobs(tiny_model_path, None, samples_batch(stopped))
    assert max_sample_logprob_diff(stopped, ref) <= 1e-5


def test_stop_strings_need_an_engine_with_a_tokenizer(tiny_model_path):
    """Without stop strings in generating_args the engine has no tokenizer: a request with
    stop strings is refused with a message saying where to put them."""
    from posttrain.backends.models import load_tokenizer
    from posttrain.launch.worker import WorkerContext
    from posttrain_vllm.engine import VLLMState, sampling_params

    worker = WorkerContext(
        role="actor_infer",
        strategy_name="vllm",
        config=None,
        model_args=ModelArgs(model_name_or_path=tiny_model_path),
    )
    worker.engine_state(VLLMState).tokenizer = load_tokenizer(worker.model_args, ".")
    assert sampling_params(worker, SamplingParams(), seed=1).stop == []
    with pytest.raises(UserError, match=r"generating_args\.stop_strings"):
        sampling_params(worker, SamplingParams(stop=("=",)), seed=1)
