"""LoRA on ``fsdp2_train`` (``model_args.lora``), through peft.

The HF model is wrapped by ``peft.get_peft_model`` before ``fully_shard``: every targeted linear
keeps its frozen base weight (``...q_proj.base_layer.weight``) and gains a trained pair
``lora_A`` / ``lora_B``. What leaves the trainer is in plain HF terms: weight sync and the merged
export send ``W + scale * B @ A`` under the base name (``...q_proj.weight``), computed from
gathered copies, never by merging into the trained model.

The reference is the base model, i.e. the actor with its adapters disabled: a reference role of
this plugin that shares the actor's processes (same devices, same model) borrows the actor's
model instead of loading a second copy (:func:`lender`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain import CheckpointError, UserError

if TYPE_CHECKING:
    from posttrain import WorkerContext

ADAPTER = "default"  # peft's name of the one adapter
LORA_RECORD = "lora.json"  # in each rank-0 checkpoint part: the base and the adapters' shape
_PEFT_PREFIX = "base_model.model."
_BASE_SEGMENT = ".base_layer."
# The LoRA actor of this process, by model path: a reference on the same ranks borrows it. One
# process hosts one rank of each role, so a module-level map is per rank.
_ACTORS: dict[str, WorkerContext] = {}


def lora_args(worker: WorkerContext):
    """The role's ``model_args.lora`` when this role trains adapters (a policy on
    ``fsdp2_train``), else None."""
    if worker.strategy_name != "fsdp2_train" or worker.head != "lm":
        return None
    return worker.model_args.lora


def wrap(worker: WorkerContext, model) -> Any:
    """``model`` with LoRA adapters on the targeted linears (base weights frozen)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    args = worker.model_args.lora
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=list(args.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        # lora_A's random init from the run's seed alone: the same on every rank and in every
        # run of the workflow, whatever drew from the global generator before (a preset built
        # on first use, another role loaded first); the global generator is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(worker.seed)
            peft_model = get_peft_model(model, config)
    except ValueError as exc:  # peft's "Target modules {...} not found in the base model"
        linears = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is torch.nn.Linear}
        )
        raise UserError(
            f"{worker.role}.model_args.lora.target_modules: {list(args.target_modules)}: {exc}; "
            f"this model's linear modules: {', '.join(linears)}"
        ) from exc
    odd = sorted(
        {
            type(m).__name__
            for m in peft_model.modules()
            if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear)
        }
    )
    if odd:
        raise UserError(
            f"{worker.role}.model_args.lora.target_modules: {list(args.target_modules)} adapts "
            f"{', '.join(odd)}; posttrain merges adapters of linear modules only: name linears"
        )
    shared = _shared_adapted_weights(peft_model)
    if shared:
        raise UserError(
            f"{worker.role}.model_args.lora.target_modules: {', '.join(shared)} shares its "
            "weight with another module (tied embeddings): its merged weight could not be "
            "synced or exported; leave it out of target_modules"
        )
    _ACTORS[worker.model_args.model_name_or_path or ""] = worker
    return peft_model


def _shared_adapted_weights(model) -> list[str]:
    """Adapted modules whose base weight is also another module's (a tied output layer)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return sorted(
        name.removeprefix(_PEFT_PREFIX)
        for name, layer in lora_layers(model).items()
        if uses.get(id(layer.base_layer.weight), 0) > 1
    )


def lender(worker: WorkerContext) -> WorkerContext | None:
    """The LoRA actor whose model this reference role can use with adapters disabled: one in
    this process, on the same ranks, of the same base model; None: load a model of its own."""
    if worker.role != "reference" or worker.head != "lm":
        return None
    actor = _ACTORS.get(worker.model_args.model_name_or_path or "")
    if actor is None or actor.world_size != worker.world_size or actor.model is None:
        return None
    return actor


def forget(worker: WorkerContext) -> None:
    """Drop ``worker`` from the lenders (its model is going away)."""
    for key, actor in list(_ACTORS.items()):
        if actor is worker:
            del _ACTORS[key]


def plain_name(name: str) -> str:
    """The HF name of a peft-wrapped parameter: ``base_model.model.model.layers.0.q_proj.
    base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    return name.removeprefix(_PEFT_PREFIX).replace(_BASE_SEGMENT, ".")


def lora_layers(model) -> dict[str, Any]:
    """``{state-dict prefix: peft LoRA linear}`` of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter_entry(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def adapter_keys(prefix: str) -> tuple[str, str]:
    return f"{prefix}.lora_A.{ADAPTER}.weight", f"{prefix}.lora_B.{ADAPTER}.weight"


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer) -> torch.Tensor:
    """``W + scale * B @ A`` in float32 (a new tensor: the trained model is untouched)."""
    delta = b.float() @ a.float()
    if layer.fan_in_fan_out:
        delta = delta.T
    return base.float() + layer.scaling[ADAPTER] * delta


def record(worker: WorkerContext) -> dict:
    """What a checkpoint of adapters needs beside them: the base they adapt and their shape."""
    return {
        "base_model": worker.model_args.model_name_or_path,
        "lora": attrs.asdict(worker.model_args.lora),
    }


def check_record(worker: WorkerContext, path: str) -> None:
    """Refuse a checkpoint whose adapters are for another base or shape, or that holds full
    weights where adapters are expected (and the other way round)."""
    file = os.path.join(path, LORA_RECORD)
    wanted = lora_args(worker)
    if not os.path.exists(file):
        if wanted is not None:
            raise CheckpointError(
                f"{path} holds full weights, not LoRA adapters: it was saved without "
                "model_args.lora; resume it without lora, or start a new run"
            )
        return
    with open(file, encoding="utf-8") as f:
        saved = json.load(f)
    if wanted is None:
        raise CheckpointError(
            f"{path} holds LoRA adapters of {saved['base_model']}, but model_args.lora is not "
            f"set; set model_args.lora: {saved['lora']} to resume it"
        )
    current = record(worker)
    for key in ("base_model", "lora"):
        if saved[key] != current[key]:
            raise CheckpointError(
                f"{path}: its adapters were trained with {key} {saved[key]!r}, this run has "
                f"{current[key]!r}; use the workflow that saved it"
            )


def adapter_config(worker: WorkerContext) -> dict:
    """peft's ``adapter_config.json`` for the exported adapter (the run's base recorded)."""
    model = worker.model
    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = worker.model_args.model_name_or_path
    config["target_modules"] = sorted(config["target_modules"])
    return config
