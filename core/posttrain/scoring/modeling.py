"""Per-token log-probs, entropy, values and sequence scores from model outputs, shared by every
HF-based backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch


def shifted_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``out[b, t] = log_softmax(logits[b, t-1] / temperature)[input_ids[b, t]]``.

    ``out[:, 0] = 0``. Computed in float32 whatever the model's dtype.
    """
    import torch

    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def shifted_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution that scored ``input_ids[:, t]``, aligned like
    :func:`shifted_token_logprobs`."""
    import torch

    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))


def shifted_values(head_out: torch.Tensor) -> torch.Tensor:
    """A value head's ``[B, T, 1]`` output aligned like log-probs: ``out[b, t]`` is the value of
    the state before token ``t`` (the head at position ``t - 1``); ``out[:, 0] = 0``. Float32."""
    import torch

    return torch.nn.functional.pad(head_out[:, :-1, 0].float(), (1, 0))


def last_position_scores(head_out: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A score head's ``[B, T, 1]`` output at each row's last attended position (rows are
    right-padded): what ``*ForSequenceClassification`` returns when padding is marked. Float32."""
    import torch

    last = attention_mask.long().sum(dim=1).clamp(min=1) - 1
    return head_out[torch.arange(head_out.shape[0], device=head_out.device), last, 0].float()


class ScoreHeadOutput:
    """Captures a sequence classifier's per-position scores during a normal forward call.

    transformers pools them at the last token that is not ``pad_token_id``, which misplaces the
    score when a response ends with the pad id (EOS is often the pad); the caller pools by the
    attention mask instead (:func:`last_position_scores`). Calling the whole model keeps
    wrappers' hooks (FSDP's unsharding) in place.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.value: torch.Tensor | None = None

    def __enter__(self) -> ScoreHeadOutput:
        def keep(_module: torch.nn.Module, _inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            self.value = output

        self._handle = self.model.score.register_forward_hook(keep)
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self._handle.remove()
        return False


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """A sequence classifier's score of every row (right-padded), float32 ``[B]``."""
    with ScoreHeadOutput(model) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return last_position_scores(captured.value, attention_mask)
