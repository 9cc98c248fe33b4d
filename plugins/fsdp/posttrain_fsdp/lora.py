"""LoRA on ``fsdp2_train`` (``model_args.lora``): what is this plugin's own.

The wrapping, the merge, the names and the checkpoint record are core's
(``posttrain.backend.wrap_lora`` and its neighbours, shared with the other trainers). The HF
model is wrapped before ``fully_shard``, so the adapters shard with their layers.

The reference is the base model, i.e. the actor with its adapters disabled: a reference role of
this plugin that shares the actor's processes (same devices, same model) borrows the actor's
model instead of loading a second copy (:func:`lender`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from posttrain.backend import wrap_lora

if TYPE_CHECKING:
    import torch

    from posttrain import WorkerContext

# The LoRA actor of this process, by model path: a reference on the same ranks borrows it. One
# process hosts one rank of each role, so a module-level map is per rank.
_ACTORS: dict[str, WorkerContext] = {}


def wrap(worker: WorkerContext, model: torch.nn.Module) -> Any:
    """``model`` with LoRA adapters (:func:`posttrain.backend.wrap_lora`), lent to a reference
    beside."""
    peft_model = wrap_lora(worker, model)
    _ACTORS[worker.model_args.model_name_or_path or ""] = worker
    return peft_model


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
