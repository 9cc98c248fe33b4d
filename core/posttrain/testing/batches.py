"""Random RL batches for backend tests that drive engines by hand."""

from __future__ import annotations

from posttrain.protocol import SequenceBatch

# Prompts of the kit's rollouts ("3+4=" ... in the tiny presets' tokens, after <bos>).
PROMPTS = [[1, 7, 14, 8, 17], [1, 5, 14, 6, 17], [1, 13, 14, 4, 17], [1, 4, 14, 4, 17]]


def random_step_batch(step: int, vocab: int, rows: int = 8) -> SequenceBatch:
    """A whole step's batch, the same on every rank for a given ``step``: random tokens (ids >= 4,
    below the special tokens' range), ragged prompt and response lengths, random per-sample
    advantages, and the global normalisation counts in ``meta``."""
    import torch

    from posttrain.protocol import build_sequence_batch

    g = torch.Generator().manual_seed(1000 + step)
    prompts, responses = [], []
    for _ in range(rows):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(1, 12, (1,), generator=g))
        prompts.append(torch.randint(4, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(4, vocab, (r,), generator=g).tolist())
    batch = build_sequence_batch(prompts, responses, pad_token_id=0)
    adv = torch.randn(rows, 1, generator=g).expand_as(batch.response_mask).contiguous()
    batch = batch.with_tensors(advantages=adv * batch.response_mask)
    batch.meta.update(global_tokens=float(batch.response_mask.sum()), global_seqs=rows)
    return batch


def on_policy_train_batch(batch: SequenceBatch, seed: int) -> SequenceBatch:
    """A rollout's samples (``batch``, with ``rollout_logprobs``) as an on-policy step hands them
    to ``train_step``: random per-sample advantages drawn from ``seed``, the rollout's log-probs
    as the old policy's, and the global normalisation counts in ``meta``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(len(batch), 1, generator=g).expand_as(batch.response_mask)
    batch = batch.with_tensors(
        advantages=adv * batch.response_mask, old_logprobs=batch["rollout_logprobs"]
    )
    batch.meta.update(global_tokens=float(batch.response_mask.sum()), global_seqs=len(batch))
    return batch
