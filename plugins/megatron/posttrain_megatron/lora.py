"""LoRA adapters on ``megatron_train``'s linears (``model_args.lora``): the plugin's own layer
over megatron-core's ColumnParallelLinear / RowParallelLinear, sharded over TP as the weight is.

HF targets map to megatron's fused modules: q_proj / k_proj / v_proj -> ``linear_qkv``, o_proj
-> ``linear_proj``, gate_proj / up_proj -> ``linear_fc1``, down_proj -> ``linear_fc2``. A fused
module takes all of its projections or none: its one ``A`` serves them all, so only q_proj of
q/k/v cannot be expressed (it is refused).

Per adapted linear ``y = base(x) + scale * B (A x)`` with ``scale = alpha / rank``:

* column-parallel (qkv, fc1): ``A`` (rank x in) is replicated, ``B`` (out/tp x rank) is sharded
  on its rows as the weight is. ``A x`` is computed on every TP rank alike and enters the TP
  region through megatron's ``copy_to_tensor_model_parallel_region`` (identity forward,
  all-reduce backward), so each rank's gradient of ``A`` is the sum over all of ``B``'s shards
  and stays equal on every rank.
* row-parallel (proj, fc2): ``A`` (rank x in/tp) is sharded on its input as the weight is;
  ``A_local x_local`` is a partial sum, all-reduced over TP
  (``reduce_from_tensor_model_parallel_region``, as the base output is reduced) into the full
  low-rank activation; ``B`` (out x rank) is replicated and applied after the reduction.
* with sequence parallelism the activations outside the TP region hold a rank's part of the
  sequence: column-parallel, ``A x_part`` is all-gathered over the sequence (its gradient
  reduce-scattered); row-parallel, the partial sums are reduce-scattered to the rank's part, as
  the base output is. The replicated half then sees part of the sequence and is tagged
  ``sequence_parallel``, so megatron sums its gradient over TP.

The adapter module hangs under its linear as ``adapter`` (parameters ``...linear_qkv.adapter.
lora_A``) and acts through a forward hook, so the base's names and forward are megatron's own.
The bridges' weight walks (HF load, export) run with the adapters detached (:func:`detached`).
``A`` is drawn as peft draws it (kaiming-uniform, a = sqrt(5)) on its full shape from the run's
seed and the module's place in the model, then cut to the rank's shard: every rank, run and
layout agrees. ``B`` starts at zero.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain import ErrorReport, UserError
from posttrain.backend import LORA_ADAPTER, lora_args, lora_scaling
from posttrain_megatron import dense_mapping
from posttrain_megatron.checks import LORA_MODULES, check_lora, lora_targets
from posttrain_megatron.wrappers import unwrap

if TYPE_CHECKING:
    from posttrain import WorkerContext

# megatron linear under a layer -> the layout of its weight (dense_mapping's).
_KINDS = {
    "self_attention.linear_qkv": dense_mapping.QKV,
    "self_attention.linear_proj": dense_mapping.ROW,
    "mlp.linear_fc1": dense_mapping.GATE_UP,
    "mlp.linear_fc2": dense_mapping.ROW,
}
_ADAPTER = "adapter"
# plugin.TRAIN: importing it (or model_builder's) would close an import circle.
TRAIN = "megatron_train"


class LoraAdapter(torch.nn.Module):
    """``scale * B (A x)`` beside one megatron parallel linear (see the module docstring)."""

    def __init__(
        self, base: torch.nn.Module, row: bool, a_full: torch.Tensor, scaling: float
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.row = row
        self.scaling = scaling
        weight = base.weight
        rank = a_full.shape[0]
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        kind = {"dtype": weight.dtype, "device": weight.device}
        a = a_full.chunk(tp, dim=1)[tp_rank] if row else a_full
        self.lora_A = torch.nn.Parameter(a.to(**kind).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, **kind))
        # The TP-sharded one of the pair: counted once per rank in the grad norm, gathered on
        # export; the replicated one has equal gradients on every TP rank.
        if row:
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
        else:
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, 1)
        # With sequence parallelism the replicated one sees only this rank's part of the
        # sequence: megatron sums its gradient over TP (finalize_model_grads), as a norm's.
        self.sequence_parallel = bool(base.sequence_parallel)
        if self.sequence_parallel:
            (self.lora_B if row else self.lora_A).sequence_parallel = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        h = torch.nn.functional.linear(x, self.lora_A)
        if self.row and self.sequence_parallel:
            # As the base output: partial sums reduce-scattered to this rank's sequence part.
            h = reduce_scatter_to_sequence_parallel_region(h)
        elif self.row:
            h = reduce_from_tensor_model_parallel_region(h)
        elif self.sequence_parallel:
            # x is this rank's sequence part: the whole sequence's low-rank activation, whose
            # gradient (partial: this rank's rows of B) is reduce-scattered back.
            h = gather_from_sequence_parallel_region(h)
        else:
            h = copy_to_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.lora_B) * self.scaling

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        return out + self.delta(args[0]), bias


def model_creation_callback(worker: WorkerContext) -> Callable[..., None]:
    """The bridge's post-model-creation callback that freezes a chunk's base weights and adds
    the adapters (before the DDP wrapper, which then buffers the adapters' gradients alone)."""
    args = lora_args(worker, TRAIN)
    if args is None:  # a plugin slip: callers check lora_args first
        raise TypeError(f"role {worker.role} trains no adapters")
    # What validation refuses (checks.check_lora), for a caller that skipped it.
    report = ErrorReport()
    check_lora(worker.role, args, worker.config, report)
    if report.errors:
        issue = report.errors[0]
        raise UserError(f"{issue.path}: {issue.message}; {issue.hint}")
    targets = lora_targets(list(args.target_modules))
    seed = worker.seed

    def add_adapters(model: torch.nn.Module, **_: Any) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        for param in model.parameters():
            param.requires_grad_(False)
        for layer in model.decoder.layers:
            number = layer.layer_number - 1  # global: the same draw under any pipeline split
            for index, target in enumerate(LORA_MODULES):
                if target not in targets:
                    continue
                base = _linear(layer, target)
                if not isinstance(base, ColumnParallelLinear | RowParallelLinear):
                    raise UserError(
                        f"{worker.role}.model_args.lora: {target} of layer {number} is "
                        f"{type(base).__name__ if base is not None else 'absent'}; "
                        "megatron_train's adapters go on megatron-core's ColumnParallelLinear / "
                        "RowParallelLinear of dense layers (attention_backend: sdpa, no "
                        "TransformerEngine layers; an MoE layer's experts are not adapted)"
                    )
                row = isinstance(base, RowParallelLinear)
                in_features = base.input_size
                a_full = torch.empty(args.rank, in_features)
                generator = torch.Generator().manual_seed(seed * 1_000_003 + number * 8 + index)
                # peft's init of lora_A (nn.Linear's): kaiming-uniform with a = sqrt(5).
                torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=generator)
                adapter = LoraAdapter(base, row, a_full, lora_scaling(args))
                base.add_module(_ADAPTER, adapter)
                base.register_forward_hook(adapter.hook)

    return add_adapters


def _linear(layer: torch.nn.Module, target: str) -> torch.nn.Module | None:
    """The layer's module ``target`` (None where it has none: an MoE layer's ``mlp``)."""
    try:
        return layer.get_submodule(target)
    except AttributeError:
        return None


def _adapted(models: list[torch.nn.Module]) -> Iterator[tuple[int, str, LoraAdapter]]:
    """``(global layer, megatron module, adapter)`` of this rank's chunks."""
    for model in models:
        for layer in unwrap(model).decoder.layers:
            for target in LORA_MODULES:
                base = _linear(layer, target)
                adapter = base._modules.get(_ADAPTER) if base is not None else None
                if isinstance(adapter, LoraAdapter):
                    yield layer.layer_number - 1, target, adapter


def adapter_parameters(models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's adapter parameters (its shards) under names unique in the model."""
    return {
        f"{layer}.{target}.{part}": getattr(adapter, part)
        for layer, target, adapter in _adapted(models)
        for part in ("lora_A", "lora_B")
    }


def portable(
    models: list[torch.nn.Module], tensors: dict[str, dict[str, torch.Tensor]]
) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Tensors of this rank's adapters (``{adapter parameter: {what: tensor of its shape}}``:
    the parameter, its optimizer state) in a form no layout depends on, on the CPU: a sharded
    one gathered over TP (collective), a column-parallel ``B`` as its HF projections' parts."""
    from megatron.core import parallel_state as ps

    dims = _dims(models)
    group = ps.get_tensor_model_parallel_group()
    out: dict[str, dict[str, list[torch.Tensor]]] = {}
    for layer, target, adapter in _adapted(models):
        for part in ("lora_A", "lora_B"):
            name = f"{layer}.{target}.{part}"
            sharded = (part == "lora_A") == adapter.row
            out[name] = {}
            for what, local in sorted(tensors[name].items()):
                local = local.detach()
                if not sharded:
                    parts = [local]
                else:
                    shards = _gather(local, group) if dims.tp > 1 else [local]
                    if adapter.row:
                        parts = [torch.cat(shards, dim=1)]
                    else:
                        parts = dense_mapping.from_shards(_KINDS[target], shards, dims)
                out[name][what] = [t.to("cpu", copy=True) for t in parts]
    return out


def localised(
    models: list[torch.nn.Module], saved: dict[str, dict[str, list[torch.Tensor]]]
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shards of :func:`portable`'s tensors, for its adapters in this layout."""
    from megatron.core import parallel_state as ps

    dims = _dims(models)
    rank = ps.get_tensor_model_parallel_rank()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for layer, target, adapter in _adapted(models):
        for part in ("lora_A", "lora_B"):
            name = f"{layer}.{target}.{part}"
            sharded = (part == "lora_A") == adapter.row
            kind = dense_mapping.ROW if adapter.row else _KINDS[target]
            out[name] = {
                what: dense_mapping.to_shard(kind, parts, dims, rank) if sharded else parts[0]
                for what, parts in saved[name].items()
            }
    return out


@contextlib.contextmanager
def detached(models: list[torch.nn.Module]) -> Iterator[None]:
    """The adapters out of the module tree (their hooks still act): the bridges' weight walks
    see megatron's base parameters alone."""
    held: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    for model in models:
        for layer in unwrap(model).decoder.layers:
            for target in LORA_MODULES:
                base = _linear(layer, target)
                adapter = base._modules.pop(_ADAPTER, None) if base is not None else None
                if base is not None and adapter is not None:
                    held.append((base, adapter))
    try:
        yield
    finally:
        for base, adapter in held:
            base.add_module(_ADAPTER, adapter)


def _dims(models: list[torch.nn.Module]) -> dense_mapping.Dims:
    from megatron.core import parallel_state as ps

    config = unwrap(models[0]).config
    return dense_mapping.Dims(
        heads=config.num_attention_heads,
        groups=config.num_query_groups,
        head_dim=config.kv_channels,
        vocab_size=0,  # no vocabulary-split tensor among the adapters
        padded_vocab_size=0,
        tied=False,
        tp=ps.get_tensor_model_parallel_world_size(),
    )


def _gather(local: torch.Tensor, group: Any) -> list[torch.Tensor]:
    local = local.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local, group=group)
    return shards


def hf_adapters(worker: WorkerContext) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{HF module: (A, B)}`` of every adapted projection, full (gathered over TP, and over
    pipeline stages), float32 on the CPU, on every rank (collective). A fused adapter is split
    as its weight is: linear_qkv's ``A`` serves q, k and v, each with its rows of ``B`` out of
    megatron's per-group q/k/v layout; linear_fc1's ``A`` serves gate and up, each with its
    half of every rank's ``B``."""
    from megatron.core import parallel_state as ps

    models = worker.model
    dims = _dims(models)
    tp_group = ps.get_tensor_model_parallel_group()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, target, adapter in _adapted(models):
        hfs, kind = LORA_MODULES[target], _KINDS[target]
        a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
        if adapter.row:
            if dims.tp > 1:
                a = torch.cat(_gather(a, tp_group), dim=1)
            b_parts = [b]
        else:
            shards = _gather(b, tp_group) if dims.tp > 1 else [b]
            b_parts = dense_mapping.from_shards(kind, shards, dims)
        for hf, b_part in zip(hfs, b_parts):
            # Copies: each projection's A is its own tensor (safetensors refuses shared ones).
            out[f"model.layers.{layer}.{hf}"] = (
                a.to("cpu", torch.float32, copy=True),
                b_part.to("cpu", torch.float32, copy=True),
            )
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, out, group=ps.get_pipeline_model_parallel_group())
        out = {name: pair for stage in stages for name, pair in stage.items()}
    return out


def merged(
    name: str,
    tensor: torch.Tensor,
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float,
) -> torch.Tensor:
    """An exported HF tensor with its adapter merged (``W + scale * B @ A``, float32) when it
    is an adapted projection's weight; the tensor itself otherwise."""
    pair = adapters.get(name.removesuffix(".weight"))
    if pair is None or not name.endswith(".weight"):
        return tensor
    a, b = pair
    return tensor.float() + scaling * (b.to(tensor.device) @ a.to(tensor.device))


def peft_tensors(
    adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The adapters under peft's state-dict names (``write_lora_adapter`` saves them)."""
    out = {}
    for module, (a, b) in adapters.items():
        out[f"base_model.model.{module}.lora_A.{LORA_ADAPTER}.weight"] = a
        out[f"base_model.model.{module}.lora_B.{LORA_ADAPTER}.weight"] = b
    return out
