"""The batch a reward model scores: the samples in the reward model's own tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.protocol import RolloutSamples, SequenceBatch, build_sequence_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def reward_model_batch(
    samples: RolloutSamples,
    policy_tokenizer: PreTrainedTokenizerBase,
    reward_tokenizer: PreTrainedTokenizerBase | None,
) -> SequenceBatch:
    """Prompt and response ids as sampled, or, when the reward model has a tokenizer of its own
    (``reward_tokenizer`` not None), their text encoded again with it."""
    if reward_tokenizer is None:
        return build_sequence_batch(
            samples.prompt_ids, samples.response_ids, policy_tokenizer.pad_token_id
        )
    prompts, responses = [], []
    for prompt, response in zip(samples.prompt_ids, samples.response_ids, strict=True):
        prompt_text = policy_tokenizer.decode(prompt, skip_special_tokens=False)
        response_text = policy_tokenizer.decode(response, skip_special_tokens=False)
        prompts.append(reward_tokenizer.encode(prompt_text, add_special_tokens=False))
        responses.append(reward_tokenizer.encode(response_text, add_special_tokens=False))
    return build_sequence_batch(prompts, responses, reward_tokenizer.pad_token_id)
