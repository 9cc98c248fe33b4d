"""The conformance kit against the real SGLang engine (CPU, torch_native attention), and stop
strings on the same engine."""

from __future__ import annotations

import os

import pytest

from posttrain.config.sections import GeneratingArgs
from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing import StrategyContract
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import max_sample_logprob_diff, reference_logprobs, samples_batch
from posttrain.testing.groups import group_spec

# Stop strings need the engine's tokenizer, which SGLang loads when the role's generating_args
# name some: the class's engine does, so the kit also runs on an engine with a tokenizer (the
# parity tests run without one).
STOP = ("1", "2", "3")


class TestSGLangContract(StrategyContract):
    strategy = "sglang"
    # Defaults already suit CPU (4096-token KV cache, torch_native attention); spelt out here.
    strategy_config = {"max_total_tokens": 4096, "attention_backend": "torch_native"}
    logprob_tolerance = 1e-5

    @pytest.fixture(scope="class")
    @classmethod
    def shared_group(cls, tiny_model_path, tmp_path_factory):
        from posttrain.launch.local import LocalLauncher

        launcher = LocalLauncher(
            call_timeout_s=cls.group_timeout_s, start_timeout_s=cls.group_timeout_s
        )
        run_dir = tmp_path_factory.mktemp("sglang-contract")
        try:
            yield launcher.start_group(
                group_spec(
                    cls.strategy,
                    dict(cls.strategy_config),
                    cls.world_size,
                    "actor_infer",
                    tiny_model_path,
                    run_dir,
                    generating=GeneratingArgs(stop_strings=list(STOP)),
                )
            )
        finally:
            launcher.shutdown()

    @pytest.fixture
    def start(self, shared_group, tiny_model_path):
        """The kit's ``start``, on one engine for the whole class (a start takes ~20 s). From the
        second test on, the engine first gets the checkpoint's weights back, so a test that
        imported other weights cannot leak them into the next (the radix cache still holds the
        earlier tests' prompts: the imports must flush it)."""
        from safetensors.torch import load_file

        from posttrain.protocol import bucketize

        def start(strategy=None, config=None, world_size=None, role="actor_infer"):
            if strategy not in (None, self.strategy) or world_size not in (None, self.world_size):
                pytest.fail("the shared-engine start serves the class's own strategy only")
            if type(self)._used:
                state = load_file(os.path.join(tiny_model_path, "model.safetensors"))
                for bucket in bucketize(sorted(state.items()), 64 << 10):
                    shared_group.call("import_weights", [bucket])
            type(self)._used = True
            return shared_group

        return start

    _used = False

    def test_stop_strings_end_a_sample_with_the_completing_token(self, start, tiny_model_path):
        """As vLLM and hf_infer: a sample ends with the token whose text completes a stop
        string; it keeps that token and its log-prob."""
        from posttrain.backends.models import load_tokenizer
        from posttrain.config.sections import ModelArgs
        from posttrain.protocol import RolloutSamples

        group = start()
        tokenizer = load_tokenizer(ModelArgs(model_name_or_path=tiny_model_path))
        sampling = SamplingParams(n=4, max_new_tokens=10, stop=STOP)
        request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3)
        out = RolloutSamples.concat(group.call_dp("generate", [request]))
        stopped = 0
        for ids in out.response_ids:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            before = tokenizer.decode(ids[:-1], skip_special_tokens=True)
            if any(s in text for s in STOP):
                assert not any(s in before for s in STOP), (ids, text)
                stopped += 1
            else:
                assert len(ids) == 10 or ids[-1] == tokenizer.eos_token_id, (ids, text)
        assert stopped >= 4, f"only {stopped} of {len(out)} samples met a stop string"
        ref = reference_logprobs(tiny_model_path, None, samples_batch(out))
        assert max_sample_logprob_diff(out, ref) <= self.logprob_tolerance

    @pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-3}], ids=["top_k", "top_p"])
    def test_top_k_and_top_p_reach_the_sampler(self, start, tiny_model_path, knob):
        """top_k=1 (or a tiny top_p) leaves one candidate: every sampled token is the argmax of
        the reference model's distribution, while the reported log-prob stays the one of the full
        distribution (before top-k/top-p)."""
        import torch
        from transformers import AutoModelForCausalLM

        from posttrain.protocol import RolloutSamples

        group = start()
        sampling = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, **knob)
        request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=5)
        out = RolloutSamples.concat(group.call_dp("generate", [request]))
        batch = samples_batch(out)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        for row, (prompt, ids) in enumerate(zip(out.prompt_ids, out.response_ids)):
            for j, token in enumerate(ids):
                assert token == int(logits[row, len(prompt) + j - 1].argmax()), (row, j)
        ref = reference_logprobs(tiny_model_path, None, batch)
        assert max_sample_logprob_diff(out, ref) <= self.logprob_tolerance
        assert any(lp < -1e-3 for lps in out.response_logprobs for lp in lps)  # not renormalised
