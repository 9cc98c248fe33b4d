"""A reward model scores through the reward role exactly as a direct transformers forward does."""

from __future__ import annotations

import pytest
import torch

from posttrain.launch.local import LocalLauncher
from posttrain.protocol import RolloutSamples
from posttrain.rewards.model import reward_model_batch
from posttrain.tasks.presets import build_tokenizer, preset_path
from posttrain.testing.groups import group_spec


@pytest.fixture(scope="module")
def reward_model_dir(posttrain_cache):
    """A tiny sequence classifier (one label), built locally."""
    return preset_path("preset:tiny-qwen2-reward")


@pytest.mark.timeout(120)
def test_reward_role_scores_equal_a_direct_forward(reward_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_tokenizer()
    samples = RolloutSamples(
        prompt_ids=[tokenizer.encode(t) for t in ("3+4=", "12+9=", "1+1=")],
        response_ids=[[*tokenizer.encode(t), tokenizer.eos_token_id] for t in ("7", "21", "3")],
        response_logprobs=[[0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0]],
    )
    batch = reward_model_batch(samples, tokenizer, None)
    launcher = LocalLauncher(call_timeout_s=60, start_timeout_s=60)
    try:
        group = launcher.start_group(
            group_spec("hf_infer", {}, 1, "reward", str(reward_model_dir), tmp_path, head="score")
        )
        scores = group.call_dp("compute_scores", [batch])[0]
    finally:
        launcher.shutdown()

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    model.eval()
    with torch.no_grad():
        direct = [
            float(model(input_ids=torch.tensor([p + r])).logits[0, 0])
            for p, r in zip(samples.prompt_ids, samples.response_ids)
        ]
    assert scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor(direct), rtol=0, atol=1e-5)
    assert len(set(direct)) == 3  # the model tells the samples apart


def test_responses_are_encoded_again_for_a_reward_model_with_its_own_tokenizer():
    from transformers import PreTrainedTokenizerFast

    policy = build_tokenizer()

    class Shifted:
        """Another tokenizer: the policy's ids plus 100."""

        pad_token_id = 999

        def encode(self, text, add_special_tokens=False):
            return [i + 100 for i in policy.encode(text)]

    assert isinstance(policy, PreTrainedTokenizerFast)
    samples = RolloutSamples(
        prompt_ids=[policy.encode("3+4=")],
        response_ids=[policy.encode("7")],
        response_logprobs=[[0.0]],
    )
    batch = reward_model_batch(samples, policy, Shifted())
    assert batch.input_ids[0].tolist() == [i + 100 for i in policy.encode("3+4=7")]
    assert batch.response_mask[0].tolist() == [0.0] * 4 + [1.0]
