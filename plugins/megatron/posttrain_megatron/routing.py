"""Routing replay (``algorithm.routing_replay``) in megatron-core's MoE routers.

The formulation is R3's (W. Ma et al., arXiv 2510.11370) and Megatron-LM's router replay
(``moe_enable_routing_replay``, ``RouterReplay``), whose hook this module uses: megatron's
``topk_routing_with_score_function`` asks ``router.router_replay.get_replay_topk`` for the top-k
of the router's scores. Here that object replays given ids: the router still computes its
logits (and softmax where it runs before the top-k), the selection is the replayed ids, the
gates are the scores gathered at them, normalised as megatron normalises its own top-k (a
softmax over the selected logits when ``moe_router_pre_softmax`` is off: Qwen3-MoE's
``norm_topk_prob``). The router's weight gets its gradient through the gathered scores.
Megatron's own ``RouterReplay`` is not used as is: it needs the model built with the flag, keeps
every router of the process in one global list and is switched to replaying for the backward
pass by its caller; here a router replays only during one schedule run
(:meth:`Routing.installed`), a forward pass replays its micro-batch (:meth:`Routing.forward`),
and a layer recomputed in the backward pass (activation recompute) replays the micro-batch it
recomputes (first in, first out per layer: megatron's schedules run backward passes in their
forward order). ``old_policy`` records the routers' own top-k in the old-policy pass, puts each
micro-batch's back together over the TP, CP and PP ranks, and keeps it by row in the engine
state's ``OldPolicyRouting`` until the update replays it.

Token order: a router sees this rank's tokens as ``[s, b]`` flattened, ``s`` the local sequence
(after the context-parallel split and the sequence-parallel scatter over TP ranks), or the one
packed row. :func:`token_positions` runs a map of positions through the same steps as the
input ids, so the batch's ``[B, T, moe_layers, k]`` routing reaches each token. Expert ids are
global (the router scores every expert), so expert parallelism changes nothing. Each pipeline
stage replays its own MoE layers: a router's global MoE index counts the MoE layers before its
(global) layer number. Padding and a packed row's filler route as the router chooses.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain.backend import ROUTING_KEY, OldPolicyRouting, rank_device, routing_dtype
from posttrain_megatron import context_parallel

if TYPE_CHECKING:
    from posttrain import SequenceBatch, WorkerContext
    from posttrain_megatron.packing import Packed

# Replay modes of a schedule's forward passes: the batch's routing, or record the routers' own.
REPLAY, RECORD = "replay", "record"
# An id the router chooses for itself (padding, a packed row's filler).
OWN = -1


def mode(worker: WorkerContext) -> str:
    """The workflow's ``algorithm.routing_replay`` (off without one)."""
    algorithm = worker.algorithm
    return getattr(algorithm, "routing_replay", "off") if algorithm is not None else "off"


def moe_routers(models: list[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """``(global MoE layer index, router)`` of every MoE layer in this rank's model chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for model in models:
        for module in model.modules():
            if isinstance(module, TopKRouter):
                out.append((_moe_index(module), module))
    return out


def _moe_index(router: torch.nn.Module) -> int:
    config = router.config
    number = router.layer_number
    if number is None or number > config.num_layers:
        raise NotImplementedError(
            "routing replay: a router outside the decoder's layers (multi-token prediction)"
        )
    if config.moe_router_fusion or getattr(router, "routing_type", "") == "sinkhorn":
        raise NotImplementedError(
            "routing replay: megatron's fused top-k and sinkhorn routing have no replay hook"
        )
    return sum(_moe_pattern(config)[: number - 1])


def _moe_pattern(config: Any) -> list[int]:
    """1 for each MoE layer of the decoder, 0 for a dense one (megatron's ``moe_layer_freq``)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(x) for x in freq]


class _LayerReplay:
    """What megatron's router calls for its top-k (in place of its ``RouterReplay``)."""

    def __init__(self, routing: Routing, layer: int) -> None:
        self.routing = routing
        self.layer = layer
        # Each forward's ids (and whether some are OWN) for this layer's recompute in the
        # backward pass.
        self.backward: collections.deque[tuple[torch.Tensor, bool]] = collections.deque()
        self.recorded: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if default_compute_topk is None:
            raise RuntimeError("routing replay: megatron's router gave no top-k function")

        def own() -> tuple[torch.Tensor, torch.Tensor]:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)

        routing = self.routing
        if routing.mode == RECORD:
            values, ids = own()
            self.recorded = ids.detach()
            return values, ids
        if routing.current is not None:  # a forward pass
            ids, has_own = routing.current[:, self.layer], routing.has_own
            if routing.keep_for_backward:
                self.backward.append((ids, has_own))
        elif self.backward:  # this layer's recompute in the backward pass
            ids, has_own = self.backward.popleft()
        else:
            raise RuntimeError("routing replay: a router ran outside a replayed forward pass")
        if ids.shape[0] != scores.shape[0] or ids.shape[1] != topk:
            raise RuntimeError(
                f"routing replay: {tuple(ids.shape)} ids for {scores.shape[0]} tokens of top-{topk}"
            )
        ids = ids.to(scores.device)
        if has_own:  # (known on the host: no device sync per layer)
            ids = torch.where(ids == OWN, own()[1], ids)
        return scores.gather(1, ids), ids


class Routing:
    """The routers of one schedule run: replay each micro-batch's ids (:meth:`forward`), or
    record the routers' own (:meth:`forward` then :meth:`recorded`)."""

    def __init__(
        self, worker: WorkerContext, models: list[torch.nn.Module], mode: str, backward: bool
    ) -> None:
        self.worker = worker
        self.mode = mode
        self.keep_for_backward = backward
        self.current: torch.Tensor | None = None
        self.has_own = False
        self.layers: list[tuple[torch.nn.Module, _LayerReplay]] = [
            (router, _LayerReplay(self, index)) for index, router in moe_routers(models)
        ]
        from megatron.core.utils import get_model_config

        config = get_model_config(models[0])
        self.moe_layers = sum(_moe_pattern(config))
        self.topk = int(config.moe_router_topk)
        # Recording: per micro-batch, [B * W, moe_layers, k] of this rank's tokens and layers.
        self.records: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[Routing]:
        saved = [router.router_replay for router, _ in self.layers]
        for router, replay in self.layers:
            router.router_replay = replay
        try:
            yield self
        finally:
            for (router, replay), previous in zip(self.layers, saved):
                router.router_replay = previous
                # Layers not recomputed leave their forward's ids behind.
                replay.backward.clear()

    @contextlib.contextmanager
    def forward(
        self, slot: int, mb: SequenceBatch, positions: torch.Tensor, width: int
    ) -> Iterator[None]:
        """Around the model's forward of micro-batch ``mb`` (``slot``: its place in the run)
        whose tokens reach the routers at ``positions`` (:func:`token_positions`) of its rows
        laid out ``width`` wide."""
        if self.mode == REPLAY:
            full = _padded_routing(mb, width)
            if full.shape[2] != self.moe_layers:
                raise RuntimeError(
                    f"routing replay: routing of {full.shape[2]} MoE layers for a model with "
                    f"{self.moe_layers}"
                )
            ids = full.flatten(0, 1)[positions.clamp(min=0)]
            ids = torch.where((positions >= 0)[:, None, None], ids, OWN)
            self.has_own = bool((ids == OWN).any())
            self.current = ids.to(rank_device(self.worker))
        try:
            yield
        finally:
            self.current = None
        if self.mode == RECORD:
            recorded = self._scatter(len(mb) * width, positions)
            if slot in self.records:  # another virtual stage's layers of the same micro-batch
                recorded = torch.maximum(self.records[slot], recorded)
            self.records[slot] = recorded

    def _scatter(self, tokens: int, positions: torch.Tensor) -> torch.Tensor:
        """The ids the routers that just ran recorded (this model chunk's), at their places of
        the micro-batch's layout; OWN for tokens of other ranks and layers of other stages."""
        out = torch.full((tokens, self.moe_layers, self.topk), OWN, dtype=torch.long)
        kept = positions >= 0
        for _, replay in self.layers:
            if replay.recorded is None:  # another virtual stage's router
                continue
            out[positions[kept], replay.layer] = replay.recorded.cpu()[kept].long()
            replay.recorded = None
        return out


def _padded_routing(mb: SequenceBatch, width: int) -> torch.Tensor:
    """The micro-batch's routing ``[B, width, moe_layers, k]`` as int64, OWN off its tokens."""
    if ROUTING_KEY not in mb.tensors:
        raise RuntimeError(
            "routing replay: the batch carries no routing (the rollout engine did not return "
            "it, or the old-policy pass did not record it)"
        )
    routing = mb[ROUTING_KEY].long()[:, :width]
    mask = mb.attention_mask[:, : routing.shape[1]].bool()
    routing = torch.where(mask[:, :, None, None], routing, OWN)
    return torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, width - routing.shape[1]), value=OWN)


def token_positions(
    worker: WorkerContext, rows: int, width: int, packed: Packed | None = None
) -> torch.Tensor:
    """Where each token a router of this rank sees sits in the micro-batch's ``[rows, width]``
    layout (flattened; -1: a packed row's filler), in the router's order: the padded layout
    ``width`` wide (a multiple of the splits') cut like the input ids by context parallelism,
    or the packed row, then the sequence-parallel scatter over TP ranks, then ``[s, b]``
    flattened."""
    from megatron.core import parallel_state as ps

    cfg = worker.config
    grid = torch.arange(rows * width).view(rows, width)
    if packed is not None:
        index, real = packed.index.cpu(), packed.real.cpu()
        flat = torch.full((packed.input_ids.shape[1],), -1, dtype=torch.long)
        flat[index[real]] = grid[:, : real.shape[1]][real]
        grid = flat[None]
    elif cfg.context_parallel_size > 1:
        cp = cfg.context_parallel_size
        grid = context_parallel.split_for_rank(grid, 1, cp, ps.get_context_parallel_rank())
    tp = cfg.tensor_model_parallel_size
    if cfg.sequence_parallel and tp > 1:
        grid = grid.chunk(tp, dim=1)[ps.get_tensor_model_parallel_rank()]
    return grid.t().reshape(-1)


def gather_records(records: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Each micro-batch's recorded routing whole: every token (the sequence and context
    parallel shards) and every MoE layer (the pipeline stages); OWN ids lose the max."""
    from megatron.core import parallel_state as ps

    if not records:
        return []
    sizes = [r.numel() for r in records]
    flat = torch.cat([r.reshape(-1) for r in records]).to(device)
    groups = []
    if ps.get_tensor_model_parallel_world_size() > 1:
        groups.append(ps.get_tensor_model_parallel_group())
    if ps.get_context_parallel_world_size() > 1:
        groups.append(ps.get_context_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        groups.append(ps.get_pipeline_model_parallel_group())
    for group in groups:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    parts = flat.cpu().split(sizes)
    return [p.view(r.shape) for p, r in zip(parts, records)]


def keep_old_policy(
    old: OldPolicyRouting,
    mb: SequenceBatch,
    rows: int,
    width: int,
    routing: torch.Tensor,
    experts: int,
) -> None:
    """The recorded ``routing`` (``[mb rows * width, moe_layers, k]``) of the micro-batch's
    first ``rows`` rows into ``old``, by each row's tokens."""
    per_row = routing.view(len(mb), width, *routing.shape[1:])
    lengths = mb.attention_mask.sum(dim=1).tolist()
    for row in range(rows):
        n = int(lengths[row])
        if bool((per_row[row, :n] == OWN).any()):
            raise RuntimeError("routing record: a MoE layer did not record every token")
        old.keep(mb.input_ids[row, :n], per_row[row, :n].to(routing_dtype(experts)))


def wants(worker: WorkerContext, models: list[torch.nn.Module]) -> bool:
    """Whether this role's passes replay or record at all (a language model with experts)."""
    return mode(worker) != "off" and worker.head == "lm" and bool(moe_routers(models))


def experts_of(models: list[torch.nn.Module]) -> int:
    routers = moe_routers(models)
    return int(routers[0][1].config.num_moe_experts) if routers else 0


def update_replays(worker: WorkerContext) -> bool:
    """Whether the update replays routing: the rollout's, or the old-policy pass's (not when
    the old log-probs come from the rollout: the update's first forward is the old policy's,
    routing alike)."""
    current = mode(worker)
    algorithm = worker.algorithm
    if current == "old_policy" and algorithm is not None:
        return algorithm.old_logprobs_source() != "rollout"
    return current == "rollout"
