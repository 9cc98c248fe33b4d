"""Each sample's routing from ``hf_infer``'s dynamic decode, for routing replay
(``algorithm.routing_replay: rollout``): the experts every MoE layer chose for each prompt token
(the prefill) and each response token (the step that fed it back).

A response's last token is never fed back (sampling ended with it): no expert saw it, and its
routing is zeros. It scores nothing: a token's log-prob depends on the tokens before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain_hf_infer.decode_loop import DynamicDecode

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain.backend import RoutingRecord


class RoutedDecode(DynamicDecode):
    """:class:`DynamicDecode` keeping, for each batch of rows it starts, the prompts' routing
    and each step's (``record``: an open :func:`posttrain.backend.record_routing`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_id: int,
        device: torch.device | str,
        record: RoutingRecord,
    ) -> None:
        super().__init__(model, pad_id, device)
        self.record = record
        # Per start: its prompts, their routing [rows, width, layers, k] (left-padded as fed),
        # and each step's [rows, layers, k].
        self.batches: list[tuple[list[list[int]], torch.Tensor, list[torch.Tensor]]] = []

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        logits = super().start(prompts)
        taken = self.record.take()
        width = max(len(p) for p in prompts)
        self.batches.append((prompts, taken.view(len(prompts), width, *taken.shape[1:]), []))
        return logits

    def step(self, token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        logits = super().step(token, running)
        self.batches[-1][2].append(self.record.take())
        return logits

    def routing(
        self, order: list[int], pool: int, responses: list[list[int]]
    ) -> list[torch.Tensor]:
        """Per sample (the prompts' order), ``[prompt + response tokens, layers, k]`` on the
        host. ``order`` and ``pool`` as :func:`~posttrain_hf_infer.decode_loop.sample_rows`
        took them: the dynamic decode starts its batches with the next ``pool`` prompts of
        ``order``, and refills none of their rows."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(responses)
        for batch, (prompts, prompt_routing, steps) in enumerate(self.batches):
            owners = order[batch * pool : batch * pool + len(prompts)]
            width, shape = prompt_routing.shape[1], prompt_routing.shape[2:]
            fed = (
                torch.stack(steps, dim=1)
                if steps
                else prompt_routing.new_zeros((len(prompts), 0, *shape))
            )
            for row, owner in enumerate(owners):
                length, drawn = len(prompts[row]), len(responses[owner])
                parts = [prompt_routing[row, width - length :], fed[row, : max(drawn - 1, 0)]]
                if drawn:
                    parts.append(prompt_routing.new_zeros((1, *shape)))
                out[owner] = torch.cat(parts).cpu()
        return out
