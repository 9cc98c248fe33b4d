"""Sibling projections of one input run as one GEMM in ``hf_infer``'s fixed-shape decode: a
layer's ``q_proj``, ``k_proj`` and ``v_proj``, and its MLP's ``gate_proj`` and ``up_proj``.

transformers' modules call each projection on its own. At a decode step's few rows those
small GEMMs run far below the GPU's rate: at 1.5B and 256 rows on an H200 the three q/k/v GEMMs
took 0.47 ms of a 3.6 ms compiled step (~96 TFLOP/s), the stacked one 0.18 ms (~250), and the
decode went from 71.4k to 81.1k tokens/s in the same run (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` exist for this).

:func:`fuse_sibling_linears` stacks a group's weights (and biases) into one tensor and makes each
``nn.Linear``'s parameter a view of its rows: parameter names, ``state_dict`` and in-place weight
syncs are unchanged, and a sync writes into the stacked tensor that the step reads. The first
projection of the group (the one the model calls first) then computes all the group's outputs
in one GEMM, while :func:`stacked_projections` is active, and hands the others theirs when the
model calls them on the same input tensor; called on any other input, a projection computes its
own output as before. Outside that block (the dynamic cache, the scoring forward passes) every
projection computes its own.

Synced LoRA adapters (:class:`~posttrain_hf_infer.adapters.AdaptedLinear`) stack too: the
members' ``A`` (rank x in each) concatenated into one ``[ranks, in]`` tensor, their ``B`` into a
block-diagonal ``[outputs, ranks]`` one (each member's ``B`` its block, the rest zero), each
member's buffers views of those: the group's output is ``x W^T + b + (x A^T) B^T * scaling``, two
small GEMMs for all the members' adapters, exactly each member's own (the zero blocks add exact
zeros), and a sync copies into the stacked tensors. A member without an adapter has no columns
in ``A`` and zero rows in ``B``.

Moving the model (``model.to``, an offload) gives each parameter its own storage again: call
:func:`unfuse_sibling_linears` first (it leaves the views, dropping what the step used), and fuse
again after the move.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import TypeAlias

import torch
import torch.nn.functional as F

from posttrain_hf_infer.adapters import AdaptedLinear

# The projections of one input, in the order transformers' layers call them: the first
# computes the group's outputs.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LinearGroup:
    """The stacked weight (and bias) of a group of projections, their stacked adapters if any
    (``lora_a``, ``lora_b``, ``scaling``: see the module docstring), and the outputs the first
    computed for the others (``pending``: its input and the outputs, until the last takes
    its own)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.scaling = 1.0
        self.active = False
        self.pending: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output on ``x``, concatenated."""
        out = F.linear(x, self.weight, self.bias)
        if self.lora_a is None or self.lora_b is None:
            return out
        return out + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


# A module a group stacks.
Grouped: TypeAlias = torch.nn.Linear | AdaptedLinear


def grouped_forward(self: Grouped, x: torch.Tensor) -> torch.Tensor:
    """A grouped projection's forward (bound to each module of a group)."""
    group, index = self.posttrain_group, self.posttrain_index
    if not group.active:
        return type(self).forward(self, x)
    if index == 0:
        outputs = group.outputs(x).split(group.sizes, dim=-1)
        group.pending = (x, outputs)
        return outputs[0]
    pending = group.pending
    if pending is None or pending[0] is not x:
        return type(self).forward(self, x)
    if index == len(group.sizes) - 1:
        group.pending = None
    return pending[1][index]


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """The parameters more than one module holds (tied, or shared across layers): stacking
    one holder's would leave the others' forward reading a tensor syncs no longer write."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, parameter in model.named_parameters(remove_duplicate=False):
        (shared if id(parameter) in seen else seen).add(id(parameter))
    return shared


def _siblings(
    module: torch.nn.Module, names: tuple[str, ...], shared: set[int]
) -> list[Grouped] | None:
    """The ``names`` children of ``module`` when they are plain linears (adapted or not) that
    can be stacked: the same input size, dtype and device, all with a bias or none, none
    grouped yet, no parameter ``shared``."""
    linears: list[Grouped] = []
    for name in names:
        linear = getattr(module, name, None)
        if type(linear) not in (torch.nn.Linear, AdaptedLinear):
            return None
        linears.append(linear)
    first = linears[0]
    weight = first.weight
    for linear in linears:
        if (
            linear.in_features != first.in_features
            or linear.weight.dtype != weight.dtype
            or linear.weight.device != weight.device
            or (linear.bias is None) != (first.bias is None)
            or hasattr(linear, "posttrain_group")
            or any(id(parameter) in shared for parameter in linear.parameters())
        ):
            return None
    return linears


def _stack(linears: list[Grouped]) -> LinearGroup:
    """One tensor for the linears' weights (and one for their biases, and their adapters'),
    each parameter now a view of its rows (the old storage is freed as the views replace
    it)."""
    sizes = [linear.out_features for linear in linears]
    first = linears[0].weight
    weight = torch.empty(sum(sizes), first.shape[1], dtype=first.dtype, device=first.device)
    bias = None
    if linears[0].bias is not None:
        bias = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
    for linear, rows in zip(linears, weight.split(sizes)):
        rows.copy_(linear.weight.data)
        linear.weight.data = rows
    if bias is not None:
        for linear, part in zip(linears, bias.split(sizes)):
            part.copy_(linear.bias.data)
            linear.bias.data = part
    group = LinearGroup(weight, bias, sizes)
    _stack_adapters(group, linears)
    return group


def _stack_adapters(group: LinearGroup, linears: list[Grouped]) -> None:
    """The adapted members' ``A`` concatenated and ``B`` block-diagonal (see the module
    docstring), each member's buffers now views of them (``.data`` swapped: the buffer objects,
    which a decode's view of the model shares, stay)."""
    adapted = [linear for linear in linears if isinstance(linear, AdaptedLinear)]
    if not adapted:
        return
    first = adapted[0].lora_A
    ranks = sum(linear.lora_A.shape[0] for linear in adapted)
    like = {"dtype": first.dtype, "device": first.device}
    lora_a = torch.empty(ranks, first.shape[1], **like)
    lora_b = torch.zeros(sum(group.sizes), ranks, **like)
    row = column = 0
    for linear in linears:
        if isinstance(linear, AdaptedLinear):
            rank = linear.lora_A.shape[0]
            a = lora_a[column : column + rank]
            b = lora_b[row : row + linear.out_features, column : column + rank]
            a.copy_(linear.lora_A)
            b.copy_(linear.lora_B)
            linear.lora_A.data, linear.lora_B.data = a, b
            column += rank
        row += linear.out_features
    group.lora_a, group.lora_b, group.scaling = lora_a, lora_b, adapted[0].scaling


@torch.no_grad()
def fuse_sibling_linears(model: torch.nn.Module) -> list[LinearGroup]:
    """Stack every group of :data:`SIBLINGS` in ``model`` (see the module docstring); the
    groups, those stacked before included."""
    groups = []
    shared = _shared_parameters(model)
    for module in model.modules():
        for names in SIBLINGS:
            group = getattr(getattr(module, names[0], None), "posttrain_group", None)
            if group is None:
                linears = _siblings(module, names, shared)
                if linears is None:
                    continue
                group = _stack(linears)
                for index, linear in enumerate(linears):
                    linear.posttrain_group, linear.posttrain_index = group, index
                    linear.forward = types.MethodType(grouped_forward, linear)  # type: ignore[method-assign]
            groups.append(group)
    return groups


def unfuse_sibling_linears(model: torch.nn.Module) -> None:
    """Every projection computes its own output again and no group holds a tensor (the
    parameters stay views of the stacked storage until moved)."""
    for module in model.modules():
        if getattr(module, "posttrain_group", None) is not None:
            del module.forward, module.posttrain_group, module.posttrain_index


@contextlib.contextmanager
def stacked_projections(groups: list[LinearGroup]) -> Iterator[None]:
    """Inside the block, each group's first projection computes the group's outputs."""
    for group in groups:
        group.active = True
    try:
        yield
    finally:
        for group in groups:
            group.active, group.pending = False, None
