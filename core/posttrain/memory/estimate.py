"""One role's device memory, estimated before anything starts: the data a strategy's
``posttrain_estimate_memory`` returns, and the formulas strategies share.

Every number is bytes on one GPU of the role. A role holds some memory between calls
(``resident``: weights, gradients, optimizer state, a rollout engine's KV cache) and needs more
while it works (``phases``: activations and logits of a micro-batch, the sampling logits of a
decode step). The plan (:mod:`posttrain.memory.plan`) adds these up per GPU and phase.

The activation formulas were fitted to what autograd saves in transformers' Qwen2 and Llama
layers with SDPA attention (``tests/core/test_memory_plan.py`` measures them with
``torch.autograd.graph.saved_tensors_hooks``): per token and layer, ``b * (8 h + 4 i + 2 kv)``
bytes for activations of ``b`` bytes (hidden ``h``, MLP width ``i``, key/value width ``kv``),
plus ``h`` float32 numbers when the activations are narrower than float32 (the RMS norms compute
in float32). Over widths from 128 to 512 and MLPs of 2.75 to 5.5 times the hidden size, in
float32 and bfloat16, that is within 6% of what autograd keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from posttrain.memory.geometry import ModelGeometry

if TYPE_CHECKING:
    from posttrain.config.sections import RoleConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Adam's two moments and a float32 master copy with its float32 gradient: 16 bytes a parameter.
ADAM_STATE_BYTES = 8
FLOAT32 = 4
GIB = 2**30

# A strategy knob that frees memory while a colocated role runs (``param_offload`` and the like):
# ``auto`` leaves it to the memory plan, which turns it on only where the GPUs would not fit
# without it (the host round trip costs time every step).
ReleaseKnob = Literal[True, False, "auto"]


def dtype_bytes(name: str | None, default: str = "fp32") -> int:
    """Bytes of one element of the dtype called ``name`` (``fp32``, ``bf16``, ``fp16``)."""
    return DTYPE_BYTES.get(name or default, FLOAT32)


@attrs.frozen(kw_only=True)
class Workload:
    """What one step asks of the roles: ``rows`` sequences of at most ``prompt_tokens`` +
    ``response_tokens``; a weight sync moves ``bucket_bytes`` at a time."""

    rows: int
    prompt_tokens: int
    response_tokens: int
    bucket_bytes: int
    mini_batches: int = 1  # optimizer steps a step's rows are split into
    samples_per_prompt: int = 1  # a rollout's rows for each prompt (GRPO's group)

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@attrs.frozen(kw_only=True)
class MemoryQuery:
    """What a strategy's estimate is made from: the role (its ``model_args`` merged with the
    workflow's), its structured ``config``, the model's geometry, the step's workload, and
    ``device`` (``cuda`` or ``cpu``)."""

    role_name: str
    role: RoleConfig
    config: Any
    geometry: ModelGeometry
    workload: Workload
    device: str = "cuda"

    @property
    def gpus(self) -> int:
        return max(1, len(self.role.device_mapping))

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.role.model_args.dtype)

    @property
    def recompute(self) -> bool:
        """Activation checkpointing is on (``model_args.disable_gradient_checkpointing: false``;
        the plan resolves ``auto`` before asking)."""
        return self.role.model_args.disable_gradient_checkpointing is False

    def rank_rows(self, data_parallel: int | None = None) -> int:
        """Rows one data-parallel rank gets in a pass (``data_parallel`` ranks; default every
        GPU of the role): a mini-batch's share."""
        ranks = data_parallel or self.gpus
        return max(1, -(-self.workload.rows // (self.workload.mini_batches * ranks)))

    def train_micro_batch_tokens(
        self, micro_batch_rows: int | None, data_parallel: int | None = None
    ) -> int:
        """Tokens of a training micro-batch: the token budget under dynamic batching (a row is
        never split, so at least one sequence), else ``micro_batch_rows`` (or
        ``per_device_train_batch_size``) sequences; never more than the rank's rows."""
        args = self.role.training_args
        sequence = self.workload.sequence_tokens
        most = self.rank_rows(data_parallel) * sequence
        if args is not None and args.use_dynamic_batch_size:
            return min(most, max(args.max_tokens_per_micro_batch, sequence))
        rows = micro_batch_rows or (args.per_device_train_batch_size if args else 1)
        return min(most, rows * sequence)

    def scoring_micro_batch_tokens(
        self, micro_batch_rows: int | None, data_parallel: int | None = None
    ) -> int:
        """Tokens of a scoring (no-grad) micro-batch: ``micro_batch_rows``, else the role's
        ``infer_batch_size``, else 8 sequences; never more than the rank's rows."""
        rows = micro_batch_rows or self.role.infer_batch_size or 8
        return min(self.rank_rows(data_parallel), rows) * self.workload.sequence_tokens


@attrs.frozen(kw_only=True)
class RoleMemory:
    """One GPU's share of a role, in bytes, by part. ``resident``: held from one call to the
    next; ``released``: the resident parts the role frees while a colocated role runs (its
    ``release_memory``); ``phases``: what each phase the role works in needs on top, by part
    (``train``, ``logprobs``, ``rollout``); ``knobs``: the settings that shrink it, as
    ``path: what to do`` lines the plan prints when a GPU does not fit; ``auto_release``: the
    config fields left at ``auto`` (:data:`ReleaseKnob`) and the resident parts each would
    free, which the plan turns on where it must (:func:`release_knobs` makes both sets)."""

    resident: Mapping[str, int]
    phases: Mapping[str, Mapping[str, int]]
    released: frozenset[str] = frozenset()
    knobs: tuple[str, ...] = ()
    auto_release: Mapping[str, frozenset[str]] = attrs.field(factory=dict)

    def held(self, active: bool) -> dict[str, int]:
        """The resident parts on the device while the role runs (``active``) or while a
        colocated role does."""
        if active:
            return dict(self.resident)
        return {k: v for k, v in self.resident.items() if k not in self.released}


def release_knobs(
    config: Any, knobs: Mapping[str, Iterable[str]]
) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The parts ``config``'s release knobs free: those of the knobs set to true, and by field
    those of the knobs left at ``auto`` (``knobs``: config field -> the resident parts it frees;
    a field the config lacks counts as off)."""
    released: set[str] = set()
    auto: dict[str, frozenset[str]] = {}
    for field, parts in knobs.items():
        value = getattr(config, field, False)
        if value is True:
            released.update(parts)
        elif value == "auto":
            auto[field] = frozenset(parts)
    return frozenset(released), auto


def layer_activation_bytes(geometry: ModelGeometry, tokens: int, dtype_bytes: int) -> int:
    """What autograd keeps of one decoder layer for ``tokens`` tokens."""
    g = geometry
    narrow = FLOAT32 * g.hidden_size if dtype_bytes < FLOAT32 else 0
    per_token = dtype_bytes * (8 * g.hidden_size + 4 * g.active_intermediate_size + 2 * g.kv_width)
    return tokens * (per_token + narrow)


def training_activation_bytes(
    geometry: ModelGeometry, tokens: int, dtype_bytes: int, recompute: bool
) -> int:
    """Activations of a training micro-batch of ``tokens`` at their peak, early in the backward
    pass: every layer's saved tensors, or with activation checkpointing each layer's input and
    one layer recomputed; plus the gradients flowing through one layer."""
    layer = layer_activation_bytes(geometry, tokens, dtype_bytes)
    hidden = tokens * geometry.hidden_size * dtype_bytes
    # The final norm keeps its input and output whether or not the layers recompute, and a
    # float32 copy of its input when the activations are narrower.
    final_norm = 2 * hidden + tokens * geometry.hidden_size * (FLOAT32 - dtype_bytes)
    if recompute:
        kept = geometry.num_hidden_layers * hidden + layer
    else:
        kept = geometry.num_hidden_layers * layer
    return kept + final_norm + layer


def forward_working_bytes(geometry: ModelGeometry, tokens: int, dtype_bytes: int) -> int:
    """A no-grad forward pass's largest temporaries: one layer's MLP (gate, up and their product)
    and the residual stream, for ``tokens`` tokens."""
    g = geometry
    return tokens * dtype_bytes * (3 * g.active_intermediate_size + 4 * g.hidden_size)


def logit_bytes(
    geometry: ModelGeometry, tokens: int, chunk_tokens: int, dtype_bytes: int, training: bool
) -> int:
    """The output head's logits for ``tokens`` tokens, ``chunk_tokens`` at a time (0: all at
    once): the head's output, its float32 copy and, in training, their gradient."""
    rows = min(tokens, chunk_tokens) if chunk_tokens > 0 else tokens
    forward = rows * geometry.vocab_size * (dtype_bytes + FLOAT32)
    return 2 * forward if training else forward


def hf_trainer_phases(
    query: MemoryQuery,
    *,
    dtype_bytes: int,
    train_tokens: int,
    score_tokens: int,
    chunk_tokens: int,
    gathered: int,
    grads: int,
) -> dict[str, dict[str, int]]:
    """The train and log-prob phases of a trainer running a transformers model: a training
    micro-batch's activations (checkpointed as ``query.recompute`` says) and logits
    (``chunk_tokens`` at a time, 0: all), its ``grads`` while they live; a scoring forward's
    working set and logits; and the ``gathered`` weights a sharded engine unshards for either."""
    g = query.geometry
    return {
        "train": {
            "grads": grads,
            "activations": training_activation_bytes(g, train_tokens, dtype_bytes, query.recompute),
            "logits": logit_bytes(g, train_tokens, chunk_tokens, dtype_bytes, training=True),
            "gathered": gathered,
        },
        "logprobs": {
            "forward": forward_working_bytes(g, score_tokens, dtype_bytes),
            "logits": logit_bytes(g, score_tokens, chunk_tokens, dtype_bytes, training=False),
            "gathered": gathered,
        },
    }


def adam_trainer_state(params: int, shards: int, master_bytes: int = FLOAT32) -> dict[str, int]:
    """Weights, gradients and AdamW's state of a trainer whose ``params`` are split over
    ``shards`` ranks, master weights and gradients of ``master_bytes`` each."""
    return {
        "weights": params * master_bytes // shards,
        "grads": params * master_bytes // shards,
        "optimizer": params * ADAM_STATE_BYTES // shards,
    }
