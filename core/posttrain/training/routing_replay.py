"""Routing replay for transformers' mixture-of-experts blocks: record the experts each token is
routed to, and replay given ones.

R3 (W. Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", arXiv 2510.11370) records the rollout engine's top-k expert ids per token and MoE layer
and replays them in the trainer's forward passes, so that both score a token with the same
experts; Megatron-LM's router replay (``moe_enable_routing_replay``, its ``RouterReplay``) does
the same inside Megatron's router. The formulation here is theirs:

- the router still computes its logits ``z = W h`` and probabilities ``p = softmax(z)``;
- the top-k *selection* is replaced by the replayed ids ``I``;
- the gates are ``p`` gathered at ``I`` (``g_i = p_i / sum_{j in I} p_j`` where the model
  renormalises its top-k: Qwen3-MoE's ``norm_topk_prob``, always in Mixtral),

so the router's weight ``W`` still gets its gradient, through the replayed experts' gates (the
ids carry none, as top-k's indices carry none).

A router is patched with forward hooks, so sharding wrappers (FSDP2, ZeRO) and gradient
checkpointing see the module they expect. Routing is compact: ``[tokens, moe_layers, k]`` in
``uint8`` when a layer has at most 256 experts, else ``int16``. This module imports torch only
inside its functions.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs

from posttrain.errors import UserError

if TYPE_CHECKING:
    import torch

    from posttrain.config.sections import Workflow
    from posttrain.launch.worker import WorkerContext
    from posttrain.protocol import SequenceBatch

# The SequenceBatch tensor of each token's routing: [B, T, moe_layers, k].
ROUTING_KEY = "routing"
MODES = ("off", "rollout", "old_policy")
# Config keys that count a layer's routed experts, by family (Qwen-MoE, Mixtral, DeepSeek).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@attrs.frozen(kw_only=True)
class _RouterKind:
    """How one transformers router class turns its logits into gates, as its ``forward`` does
    (an exact copy: replaying the ids it chose reproduces its gates bitwise)."""

    normalises: Callable[[Any], bool]
    # The gates cast back to the logits' dtype (Qwen3-MoE) or left float32 (Mixtral).
    cast_back: bool


# transformers >= 5: the router is a module of its own returning (logits, gates, ids); the
# sparse block hands gates and ids to its experts.
_ROUTERS = {
    "Qwen3MoeTopKRouter": _RouterKind(
        normalises=lambda router: bool(router.norm_topk_prob), cast_back=True
    ),
    "MixtralTopKRouter": _RouterKind(normalises=lambda router: True, cast_back=False),
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, one per MoE layer, in layer order (a wrapped model's too)."""
    return [m for m in model.modules() if type(m).__name__ in _ROUTERS]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of expert ids: uint8 up to 256 experts, else int16."""
    import torch

    return torch.uint8 if num_experts <= 256 else torch.int16


def routing_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(moe_layers, k, experts)`` of ``model``; a model with experts of a kind this module
    cannot replay is refused (a user error naming it)."""
    routers = moe_routers(model)
    if not routers:
        config = getattr(model, "config", None)
        experts = _config_experts(config.to_dict() if config is not None else {})
        kind = type(model).__name__
        if experts:
            raise UserError(
                f"routing replay: {kind} has {experts} experts a layer, but its router is not "
                f"one routing replay knows ({', '.join(sorted(_ROUTERS))}); set "
                "algorithm.routing_replay: off"
            )
        raise UserError(f"routing replay: {kind} has no mixture-of-experts layers")
    first = routers[0]
    return len(routers), int(first.top_k), int(first.num_experts)


def _config_experts(config: dict[str, Any]) -> int:
    text = config.get("text_config") or config
    return max((int(text.get(key) or 0) for key in _EXPERT_KEYS), default=0)


class RoutingRecord:
    """What :func:`record_routing` saw: each router call's ids, kept on the device until
    :meth:`take`."""

    def __init__(self, layers: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.calls: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def take(self) -> torch.Tensor:
        """``[tokens, moe_layers, k]`` of the forward calls since the last take (their tokens
        in call order, each call's flattened as the model flattens ``[B, T]``), and forget
        them."""
        import torch

        counts = {len(calls) for calls in self.calls}
        if counts != {len(self.calls[0])}:
            raise RuntimeError(f"routing record: MoE layers ran {sorted(counts)} times each")
        per_layer = [torch.cat(calls, dim=0) for calls in self.calls]
        for calls in self.calls:
            calls.clear()
        return torch.stack(per_layer, dim=1)


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[RoutingRecord]:
    """Record, meanwhile, each MoE layer's top-k expert ids of every token the model runs
    (inside :func:`replay_routing`: the replayed ids)."""
    layers, _, experts = routing_geometry(model)
    record = RoutingRecord(layers, routing_dtype(experts))

    def hook(layer: int) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            record.calls[layer].append(output[2].detach().to(record.dtype))

        return keep

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(moe_routers(model))]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


class RoutingReplay:
    """The ids :func:`replay_routing` replays: set with :meth:`use`, kept until the next
    ``use`` (a backward pass that recomputes checkpointed layers replays them again).

    It also counts, over the tokens :meth:`forward` marks as carrying the rollout's routing,
    how often the trainer's own router would have chosen the same top-k set and how many
    tokens each expert received: :meth:`consistency`."""

    def __init__(self, layers: int, experts: int = 0) -> None:
        self.layers = layers
        self.experts = experts
        self.ids: torch.Tensor | None = None
        # Which of the replayed tokens count (a flat [tokens] bool), set by forward().
        self.counted: torch.Tensor | None = None
        self._agree: list[Any] = [0] * layers
        self._tokens: list[Any] = [0] * layers
        self._load: list[Any] = [None] * layers

    def use(self, routing: torch.Tensor | None) -> None:
        """Replay ``routing`` (``[tokens, moe_layers, k]``, or ``[B, T, moe_layers, k]`` for a
        ``[B, T]`` forward) in the following forward calls; None: each router routes itself."""
        if routing is not None:
            routing = routing.reshape(-1, *routing.shape[-2:])
            if routing.shape[1] != self.layers:
                raise RuntimeError(
                    f"routing replay: routing of {routing.shape[1]} MoE layers for a model "
                    f"with {self.layers}"
                )
        self.ids = routing

    def forward(self, forward: Callable[[SequenceBatch], Any]) -> Callable[[SequenceBatch], Any]:
        """``forward(micro_batch)`` that replays the micro-batch's ``routing`` tensor
        (:data:`ROUTING_KEY`, cut to its width) and fails where it has none."""

        def routed(mb: SequenceBatch) -> Any:
            if ROUTING_KEY not in mb.tensors:
                raise RuntimeError(
                    "routing replay: the batch carries no routing (the rollout engine did not "
                    "return it, or the old-policy pass did not record it)"
                )
            width = mb.input_ids.shape[1]
            self.use(mb[ROUTING_KEY][:, :width])
            self.counted = _routed_tokens(mb.attention_mask).reshape(-1)
            return forward(mb)

        return routed

    def consistency(self, device: torch.device | str) -> dict[str, float]:
        """``moe/routing_agreement``: the fraction of (token, MoE layer) pairs whose replayed
        top-k set is the one the trainer's router chose itself; ``moe/expert_load_max``: the
        busiest expert's tokens over the mean expert's, in the worst layer (1.0: balanced).
        Over the tokens every rank of the default group replayed since the context opened (a
        collective: every rank calls it); empty when none were."""
        import torch

        from posttrain.backends.distributed import all_reduce_sum

        counts = torch.zeros(2 + self.layers * self.experts, dtype=torch.float64, device=device)
        counts[0] = sum(float(a) for a in self._agree)
        counts[1] = sum(float(t) for t in self._tokens)
        for layer, load in enumerate(self._load):
            if load is not None:
                start = 2 + layer * self.experts
                counts[start : start + self.experts] = load.to(device)
        counts = all_reduce_sum(counts)
        if not counts[1]:
            return {}
        loads = counts[2:].view(self.layers, self.experts)
        worst = loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)
        return {
            "moe/routing_agreement": float(counts[0] / counts[1]),
            "moe/expert_load_max": float(worst.max()),
        }

    def _count(self, layer: int, own: torch.Tensor, replayed: torch.Tensor) -> None:
        import torch

        counted = self.counted
        if counted is None or counted.shape[0] != replayed.shape[0]:
            return  # a forward outside forward() (no tokens marked): nothing to count
        counted = counted.to(replayed.device)
        with torch.no_grad():
            same = (own.sort(dim=-1).values == replayed.sort(dim=-1).values).all(dim=-1)
            self._agree[layer] += same[counted].sum()
            self._tokens[layer] += counted.sum()
            load = torch.bincount(replayed[counted].reshape(-1), minlength=self.experts)
            previous = self._load[layer]
            self._load[layer] = load if previous is None else previous + load

    def gates(self, layer: int, kind: _RouterKind, router: Any, output: Any) -> Any:
        logits = output[0]
        if self.ids is None:
            return output
        if self.ids.shape[0] != logits.shape[0]:
            raise RuntimeError(
                f"routing replay: {self.ids.shape[0]} tokens of routing for a forward pass "
                f"of {logits.shape[0]}"
            )
        import torch

        ids = self.ids[:, layer].to(device=logits.device, dtype=torch.long)
        self._count(layer, output[2], ids)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        gates = probs.gather(1, ids)
        if kind.normalises(router):
            gates = gates / gates.sum(dim=-1, keepdim=True)
        if kind.cast_back:
            gates = gates.to(logits.dtype)
        return logits, gates, ids


@contextlib.contextmanager
def replay_routing(
    model: torch.nn.Module, routing: torch.Tensor | None = None
) -> Iterator[RoutingReplay]:
    """Replay ``routing`` (see :meth:`RoutingReplay.use`; change it with ``use``) in the MoE
    layers' forward calls meanwhile: each router's logits and softmax as usual, its top-k
    replaced by the replayed ids, the gates its probabilities at those ids (renormalised where
    the model renormalises). Keep the context open through the backward pass when layers are
    recomputed (gradient checkpointing)."""
    layers, _, experts = routing_geometry(model)
    replay = RoutingReplay(layers, experts)
    replay.use(routing)

    def hook(layer: int, kind: _RouterKind) -> Callable[..., Any]:
        def swap(module: torch.nn.Module, args: Any, output: Any) -> Any:
            return replay.gates(layer, kind, module, output)

        return swap

    handles = [
        r.register_forward_hook(hook(i, _ROUTERS[type(r).__name__]))
        for i, r in enumerate(moe_routers(model))
    ]
    try:
        yield replay
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------
# The passes of a trainer of transformers models under algorithm.routing_replay
# --------------------------------------------------------------------------------------------


def replay_mode(worker: WorkerContext) -> str:
    """The workflow's ``algorithm.routing_replay`` as this rank sees it (off without one)."""
    return getattr(worker.algorithm, "routing_replay", "off") if worker.algorithm else "off"


class OldPolicyRouting:
    """``routing_replay: old_policy``: the routing the trainer's old-policy pass recorded, by
    each row's tokens, until the update replays it. By tokens, not by row: the update's
    mini-batches may give a rank rows another rank scored (then the ranks pool theirs)."""

    def __init__(self) -> None:
        self.rows: dict[bytes, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(
        self, model: torch.nn.Module, forward: Callable[[SequenceBatch], Any]
    ) -> Iterator[Callable[[SequenceBatch], Any]]:
        """``forward`` recording each real row's routing (this pass's replaces the last's)."""
        self.rows = {}
        with record_routing(model) as record:

            def recorded(mb: SequenceBatch) -> Any:
                out = forward(mb)
                taken = record.take().cpu()
                routing = taken.view(*mb.input_ids.shape, *taken.shape[1:])
                lengths = mb.attention_mask.sum(dim=1).tolist()
                for row, length in enumerate(lengths):
                    n = int(length)
                    self.keep(mb.input_ids[row, :n], routing[row, :n])
                return out

            yield recorded

    def keep(self, ids: torch.Tensor, routing: torch.Tensor) -> None:
        """Keep one row's routing (``[tokens, moe_layers, k]``) under its tokens ``ids`` (the
        row without padding): for a trainer that records its old-policy pass its own way."""
        self.rows[_row_key(ids)] = routing

    def attach(self, batch: SequenceBatch, device: torch.device | str) -> SequenceBatch:
        """``batch`` with the recorded ``routing`` of its rows (pooled over the default group's
        ranks when one of them lacks a row)."""
        from posttrain.backends.distributed import agree_max

        keys = [_row_key(ids) for ids in _rows(batch)]
        if agree_max(int(any(k not in self.rows for k in keys)), device):
            import torch.distributed as dist

            pooled: list[dict[bytes, torch.Tensor]] = [{}] * dist.get_world_size()
            dist.all_gather_object(pooled, self.rows)
            for rows in pooled:
                self.rows.update(rows)
        missing = sum(k not in self.rows for k in keys)
        if missing:
            raise RuntimeError(
                f"routing replay (old_policy): {missing} of {len(keys)} rows of the update were "
                "not scored by the old-policy pass"
            )
        from posttrain.protocol import routing_tensor

        lengths = batch.attention_mask.sum(dim=1).tolist()
        routing = routing_tensor([self.rows[k] for k in keys], lengths, batch.input_ids.shape[1])
        return batch.with_tensors(**{ROUTING_KEY: routing})


def _routed_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the tokens whose routing the rollout engine chose, every real token but
    each row's last (the last sampled token never went through the engine's model)."""
    real = attention_mask.bool()
    last = attention_mask.long().cumsum(dim=1) == attention_mask.sum(dim=1, keepdim=True)
    return real & ~(last & real)


def _rows(batch: SequenceBatch) -> list[torch.Tensor]:
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [batch.input_ids[i, : int(n)] for i, n in enumerate(lengths)]


def _row_key(ids: torch.Tensor) -> bytes:
    import torch

    return ids.to(device="cpu", dtype=torch.int64).numpy().tobytes()


@contextlib.contextmanager
def scoring_forward(
    worker: WorkerContext,
    model: torch.nn.Module,
    forward: Callable[[SequenceBatch], Any],
    old_policy: OldPolicyRouting | None = None,
) -> Iterator[Callable[[SequenceBatch], Any]]:
    """The forward of a log-prob pass under the workflow's routing replay: ``rollout``
    replays the batch's routing (the old-policy and reference passes; not in a reference
    without experts); ``old_policy`` records it into ``old_policy`` (the trainer's old-policy
    pass; None for other roles); else ``forward`` as it is."""
    mode = replay_mode(worker)
    if mode == "rollout" and moe_routers(model):
        with replay_routing(model) as replay:
            yield replay.forward(forward)
    elif mode == "old_policy" and old_policy is not None:
        with old_policy.recording(model, forward) as recorded:
            yield recorded
    else:
        yield forward


@contextlib.contextmanager
def update_forward(
    worker: WorkerContext,
    model: torch.nn.Module,
    batch: SequenceBatch,
    forward: Callable[[SequenceBatch], Any],
    old_policy: OldPolicyRouting,
    device: torch.device | str,
    metrics: dict[str, float] | None = None,
) -> Iterator[tuple[SequenceBatch, Callable[[SequenceBatch], Any]]]:
    """The update's batch and forward under the workflow's routing replay (keep it open
    through the backward passes): ``rollout`` replays the batch's routing, ``old_policy`` the
    old-policy pass's (none when the old log-probs come from the rollout: the update's first
    forward is the old policy's, routing alike). A critic, or a model without experts, routes
    by itself (validation refuses routing replay for an actor without experts).

    With ``rollout``, ``metrics`` gets, when the context closes, how the trainer's own routing
    compares with the rollout's over every rank's tokens (:meth:`RoutingReplay.consistency`:
    ``moe/routing_agreement``, ``moe/expert_load_max``, alike on every rank), for the train
    step's metrics."""
    mode = replay_mode(worker)
    algorithm = worker.algorithm
    if (
        mode == "off"
        or (
            mode == "old_policy"
            and algorithm is not None
            and algorithm.old_logprobs_source() == "rollout"
        )
        # A critic (its values' passes replay nothing either), or a model without experts.
        or worker.head != "lm"
        or not moe_routers(model)
    ):
        yield batch, forward
        return
    if mode == "old_policy":
        batch = old_policy.attach(batch, device)
    with replay_routing(model) as replay:
        yield batch, replay.forward(forward)
        if mode == "rollout" and metrics is not None:
            metrics.update(replay.consistency(device))


# --------------------------------------------------------------------------------------------
# Validation (no torch): does the model have experts routing replay can replay?
# --------------------------------------------------------------------------------------------


def model_experts(model_name_or_path: str | None, base_dir: str = ".") -> int | None:
    """Routed experts per MoE layer of a ``model_name_or_path`` from its ``config.json`` (a
    preset's definition, a local directory, a hub id in the local HF cache; 0: a dense model);
    None where that cannot be known without the network or a build."""
    if not model_name_or_path:
        return None
    from posttrain.memory.geometry import _cached_hub_config
    from posttrain.tasks.presets import PRESETS, is_preset, preset_name

    if is_preset(model_name_or_path):
        return PRESETS[preset_name(model_name_or_path)].num_experts
    path = model_name_or_path
    if not os.path.isabs(path):
        local = os.path.join(base_dir, path)
        path = local if os.path.isdir(local) else path
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        config = _cached_hub_config(model_name_or_path) or ""
    if not config:
        return None
    with open(config) as f:
        return _config_experts(json.load(f))


def routing_replay_problem(workflow: Workflow) -> tuple[str, str, str] | None:
    """``(YAML path, message, hint)`` when ``algorithm.routing_replay`` is on for an
    ``actor_train`` model known to have no experts; None otherwise (also when unknown)."""
    mode = workflow.algorithm.routing_replay
    actor = workflow.roles().get("actor_train")
    if mode == "off" or actor is None:
        return None
    name = actor.model_args.model_name_or_path
    try:
        experts = model_experts(name, workflow.base_dir)
    except UserError:  # an unknown preset: the model checks report it
        return None
    if experts != 0:
        return None
    return (
        "algorithm.routing_replay",
        f"routing_replay: {mode} replays the experts of a mixture-of-experts model, but "
        f"{name} has none (its config names no {', '.join(_EXPERT_KEYS)})",
        "set algorithm.routing_replay: off",
    )
