"""fsdp2_infer as the reward role: a sequence classifier sharded over 2 ranks scores as a direct
transformers forward does."""

from __future__ import annotations

import pytest
import torch

from posttrain.launch.local import LocalLauncher
from posttrain.protocol import RolloutSamples
from posttrain.rewards.model import reward_model_batch
from posttrain.tasks.presets import build_tokenizer, preset_path
from posttrain.testing.groups import group_spec


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_reward_model_scores_equal_a_direct_forward(tmp_path, posttrain_cache):
    from transformers import AutoModelForSequenceClassification

    path = preset_path("preset:tiny-qwen2-reward")
    tokenizer = build_tokenizer()
    texts = [("3+4=", "7"), ("12+9=", "21"), ("1+1=", "3"), ("9+9=", "18")]
    samples = RolloutSamples(
        prompt_ids=[tokenizer.encode(p) for p, _ in texts],
        response_ids=[[*tokenizer.encode(r), tokenizer.eos_token_id] for _, r in texts],
        response_logprobs=[[0.0] * (len(r) + 1) for _, r in texts],
    )
    batch = reward_model_batch(samples, tokenizer, None)
    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=120)
    try:
        group = launcher.start_group(
            group_spec("fsdp2_infer", {}, 2, "reward", path, tmp_path, head="score")
        )
        shares = group.call_dp("compute_scores", batch.split(group.dp_size))
    finally:
        launcher.shutdown()
    scores = torch.cat(shares)

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        direct = [
            float(model(input_ids=torch.tensor([p + r])).logits[0, 0])
            for p, r in zip(samples.prompt_ids, samples.response_ids)
        ]
    torch.testing.assert_close(scores, torch.tensor(direct), rtol=0, atol=1e-5)
