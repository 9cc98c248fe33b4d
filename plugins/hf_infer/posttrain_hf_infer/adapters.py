"""Synced LoRA adapters in ``hf_infer`` (``model_args.lora.sync: adapter``): the engine keeps its
base weights and adds each adapter's low-rank product, as the trainer's peft model does.

At load every targeted linear (its name's last component in ``target_modules``, peft's rule)
becomes an :class:`AdaptedLinear`: the same weight and bias parameters (names, ``state_dict`` and
tied weights unchanged) and two buffers, ``lora_A`` (rank x in) and ``lora_B`` (out x rank), in
the weight's dtype and device, zero until the first sync (peft's ``B`` starts at zero: the base
alone is the policy). Its forward is peft's: ``base(x) + lora_B(lora_A(x)) * scaling``. The
buffers are allocated once: a sync copies into them (:func:`adapter_buffers` names them as the
wire does), so a captured CUDA graph or a compiled step reads the new adapters without being
captured again. The buffers are not persistent: the model's ``state_dict`` stays that of the
base model; a rollout checkpoint adds them under their wire names, an HF export merges them
(:func:`merged_state`).

A stacked group of projections (:mod:`~posttrain_hf_infer.fused_linears`) stacks its members'
adapters too, so it stays one GEMM for the base and two for the adapters.

Not a ``torch.nn.Linear`` subclass on purpose: the chunked log-prob head multiplies hidden
states by a plain linear head's weight (``posttrain.backend.logprob_forward`` checks for one),
which would skip an adapted head's adapter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from posttrain import UserError


class AdaptedLinear(torch.nn.Module):
    """A linear layer with a synced LoRA adapter (see the module docstring)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, rank: int, scaling: float) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The linear's own parameters: a tied or shared weight stays shared.
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.scaling = scaling
        like = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        lora_a = torch.zeros(rank, self.in_features, **like)
        lora_b = torch.zeros(self.out_features, rank, **like)
        self.register_buffer("lora_A", lora_a, persistent=False)
        self.register_buffer("lora_B", lora_b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # peft's order: the base's output, plus the adapters' scaled after the up-projection.
        adapted = F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling
        return F.linear(x, self.weight, self.bias) + adapted

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.lora_A.shape[0]}, scaling={self.scaling}"
        )


def attach_adapters(
    model: torch.nn.Module, target_modules: Sequence[str], rank: int, scaling: float
) -> list[str]:
    """Replace every linear of ``model`` that ``target_modules`` names (``model_args.lora``'s)
    by an :class:`AdaptedLinear` with zero adapters of ``rank``, their product scaled by
    ``scaling``; the names of the adapted modules. A targeted module that is not a plain
    ``torch.nn.Linear``, or no target at all, is a ``UserError``."""
    targets = set(target_modules)
    matched = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
    odd = [f"{n} ({type(m).__name__})" for n, m in matched if type(m) is not torch.nn.Linear]
    if odd:
        raise UserError(
            f"hf_infer: model_args.lora.target_modules {list(target_modules)} names "
            f"{', '.join(odd[:5])}: hf_infer applies synced adapters to plain linear modules "
            "only; leave it out of target_modules, or set lora.sync: merged"
        )
    if not matched:
        raise UserError(
            f"hf_infer: model_args.lora.target_modules {list(target_modules)} names no "
            f"module of {type(model).__name__}"
        )
    for name, linear in matched:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, AdaptedLinear(linear, rank, scaling))
    return [name for name, _ in matched]


def adapter_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' buffers by their names on the wire (``<module>.lora_A.weight``,
    ``<module>.lora_B.weight``): what a sync copies into. Empty without adapters."""
    buffers = {}
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            buffers[f"{name}.lora_A.weight"] = module.lora_A
            buffers[f"{name}.lora_B.weight"] = module.lora_B
    return buffers


def merged_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's own ``state_dict``) with each adapted module's weight merged,
    ``W + scaling * B @ A`` in float32 then the weight's dtype: the policy as a plain HF model
    (an HF export). A non-zero adapter on a weight another module shares (a tied head) is a
    ``UserError``: the export saves that weight once, as the other module's."""
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    merged = dict(state)
    for name, module in model.named_modules():
        if not isinstance(module, AdaptedLinear) or not module.lora_B.any():
            continue
        if uses[id(module.weight)] > 1:
            raise UserError(
                f"hf_infer: {name} shares its weight with another module (tied embeddings): "
                "an HF export cannot hold its merged weight; leave it out of "
                "model_args.lora.target_modules"
            )
        key = f"{name}.weight"
        weight = merged[key]
        delta = module.lora_B.float() @ module.lora_A.float() * module.scaling
        merged[key] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged
