"""Mixture-of-experts models in ``hf_infer``'s fixed-shape decode
(:mod:`~posttrain_hf_infer.static_decode`): experts whose one-token step a CUDA graph and
``torch.compile`` capture, and each token's routing recorded inside that step.

Experts. transformers (>= 5) runs a Qwen3-MoE or Mixtral layer's experts by
``config._experts_implementation``: ``eager`` loops over the experts hit in Python (a host sync
to find them, a launch or three per expert: neither a graph nor a compile takes it);
``grouped_mm`` sorts the token-expert pairs by expert and runs each projection as one
``torch._grouped_mm`` over all experts (static shapes: the counts per expert are a tensor, no
sync); ``batched_mm`` gathers each pair's expert weights (one ``bmm``, its bytes the pairs' k
times a token's experts: only for few rows). The decode's view of the model
(:func:`~posttrain_hf_infer.static_decode.step_view`, its own config) runs ``grouped_mm``
unless the model was loaded with ``batched_mm``; the model itself (training, scoring, the
dynamic decode) keeps its own.

Routing. A decoder keeps, per MoE layer, each row's top-k expert ids at each cache slot
(``[rows, cache length, k]``, uint8 up to 256 experts, else int16): the slots of the KV cache,
so a row's routing is where its keys are. The view's routers write them inside the step
(:func:`routed_forward`): a prefill fills every row's first slots, a one-token step writes each
running row's token at its query slot (a row that stopped writes nothing: its last fed token's
routing stays). Fixed addresses: the captured graph writes the same buffers at every replay.
A refilled row's prompt (run on the model itself, with its own attention) is recorded by
``record_routing`` and copied into its slots. :class:`RoutingSlots` hands each sample's routing
over when its row ends, as :class:`~posttrain_hf_infer.routing.RoutedDecode` does for the
dynamic decode: the prompt's tokens, each fed-back response token, and zeros for the last one
(never fed back).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from posttrain.backend import moe_routers, record_routing, routing_dtype, routing_geometry

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# transformers' experts implementations whose step has static shapes and no host sync.
CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")


class RoutingSlots:
    """Each MoE layer's expert ids per row and cache slot of a decoder (``[rows, length, k]``
    a layer, see the module docstring). ``current`` and ``advance``: the decoder's query slots
    and running rows (``[rows, 1]``), read by the step that writes."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        length: int,
        current: torch.Tensor,
        advance: torch.Tensor,
    ) -> None:
        layers, k, experts = routing_geometry(model)
        like = {"dtype": routing_dtype(experts), "device": current.device}
        self.layers = [torch.zeros(rows, length, k, **like) for _ in range(layers)]
        self.current, self.advance = current, advance

    def refilled(self, model: PreTrainedModel, index: torch.Tensor, run: Any) -> Any:
        """``run()``, a forward pass of prompts left-padded to a width (one row each for the
        rows ``index``) on ``model`` itself: its routing copied into those rows' first slots.
        What ``run`` returns."""
        with record_routing(model) as record:
            out = run()
        taken = record.take()  # [rows x width, layers, k]
        taken = taken.view(len(index), -1, *taken.shape[1:])
        for layer, ids in enumerate(self.layers):
            ids[index, : taken.shape[1]] = taken[:, :, layer]
        return out

    def samples(
        self, rows: list[int], starts: list[int], fed: list[int], drawn: list[int]
    ) -> list[torch.Tensor]:
        """On the host, per row of ``rows``: ``[tokens, layers, k]`` of its slots ``starts[i]``
        to ``starts[i] + fed[i]`` (its prompt and the response tokens fed back), then a zero
        row where it drew a token that was never fed back (``drawn[i] > 0``: its last)."""
        index = torch.tensor(rows, device=self.current.device)
        end = max(start + count for start, count in zip(starts, fed))
        taken = torch.stack([ids[index, :end] for ids in self.layers], dim=2).cpu()
        out = []
        for i, (start, count) in enumerate(zip(starts, fed)):
            parts = [taken[i, start : start + count]]
            if drawn[i]:
                parts.append(taken.new_zeros((1, *taken.shape[2:])))
            out.append(torch.cat(parts))
        return out


def is_moe(model: PreTrainedModel) -> bool:
    """Whether ``model`` has MoE routers routing capture knows (Qwen3-MoE's, Mixtral's)."""
    return bool(moe_routers(model))


def routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> Any:
    """A view's router: the router class's own forward, its top-k ids written into the
    decoder's slots (``self.posttrain_routing``, see the module docstring)."""
    logits, gates, ids = type(self).forward(self, hidden_states)
    write_routing(self.posttrain_routing, self.posttrain_current, self.posttrain_advance, ids)
    return logits, gates, ids


def write_routing(
    slots: torch.Tensor, current: torch.Tensor, advance: torch.Tensor, ids: torch.Tensor
) -> None:
    """``ids`` (``[tokens, k]``, tokens flattened as the model flattens ``[rows, q]``) into
    ``slots`` (``[rows, length, k]``): one token a row at its query slot ``current``, where the
    row runs (``advance``); longer inputs (a prefill) into every row's first slots."""
    rows = slots.shape[0]
    ids = ids.to(slots.dtype)
    if ids.shape[0] == rows:
        at = torch.arange(rows, device=slots.device)
        where = current.view(-1)
        slots[at, where] = torch.where(advance.view(-1, 1) > 0, ids, slots[at, where])
    else:
        slots[:, : ids.shape[0] // rows] = ids.view(rows, -1, ids.shape[-1])


def install(view: torch.nn.Module, routing: RoutingSlots) -> None:
    """Make ``view`` (a decoder's :func:`~posttrain_hf_infer.static_decode.step_view`) a
    capturable MoE step: its experts' implementation one of :data:`CAPTURABLE_EXPERTS`, its
    routers writing into ``routing``. Its routers drop the hooks the view copied (a
    ``record_routing`` of a refill, open while the view was made, would be traced into the
    step)."""
    for module in view.modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_experts_implementation", None)
        if implementation is not None and implementation not in CAPTURABLE_EXPERTS:
            config._experts_implementation = "grouped_mm"  # type: ignore[union-attr]
    for router, ids in zip(moe_routers(view), routing.layers):
        router._forward_hooks = OrderedDict()
        router.forward = types.MethodType(routed_forward, router)
        router.posttrain_routing = ids
        router.posttrain_current = routing.current
        router.posttrain_advance = routing.advance
