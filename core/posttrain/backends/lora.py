"""LoRA adapters (``model_args.lora``) on a trainer's HF model, through peft: the pieces every
trainer with the ``lora`` capability shares.

A trainer wraps its HF model with :func:`wrap_lora` before its engine shards it: every targeted
linear keeps its frozen base weight (``...q_proj.base_layer.weight``) and gains a trained pair
``lora_A`` / ``lora_B``. What leaves the trainer is in plain HF terms: the merged export, and
weight sync with ``sync: merged``, send ``W + scale * B @ A`` (:func:`merge_lora_weight`) under
the base name (:func:`lora_plain_name`), computed from gathered copies, never by merging into
the trained model; weight sync with ``sync: adapter`` sends the adapters alone under
:func:`adapter_wire_name`, and the engine applies them (:func:`synced_adapter`).
A checkpoint of adapters records the base they adapt (:func:`lora_record`), checked on load
(:func:`check_lora_record`); the adapter export is peft's format (:func:`write_lora_adapter`).
peft is imported only when a function needs it: it is a dependency of the trainers' plugins,
not of core.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain.errors import CheckpointError, UserError

if TYPE_CHECKING:
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    from posttrain.config.sections import LoraArgs
    from posttrain.launch.worker import WorkerContext

LORA_ADAPTER = "default"  # peft's name of the one adapter
LORA_RECORD = "lora.json"  # in each rank-0 checkpoint part: the base and the adapters' shape
_PEFT_PREFIX = "base_model.model."
_BASE_SEGMENT = ".base_layer."


def lora_args(worker: WorkerContext, train_strategy: str) -> LoraArgs | None:
    """The role's ``model_args.lora`` when it trains adapters (a policy on ``train_strategy``,
    the plugin's trainer), else None."""
    if worker.strategy_name != train_strategy or worker.head != "lm":
        return None
    return worker.model_args.lora


def adapter_sync(worker: WorkerContext, train_strategy: str) -> bool:
    """Whether this trainer's weight syncs send its adapters alone (``model_args.lora.sync:
    adapter``, resolved before any process starts), named by :func:`adapter_wire_name`, rather
    than the merged weights."""
    args = lora_args(worker, train_strategy)
    return args is not None and args.sync == "adapter"


def synced_adapter(worker: WorkerContext) -> LoraArgs | None:
    """For the rollout role: the adapters its weight syncs carry (rank, alpha, target modules),
    which its engine applies over base weights it keeps; None: syncs carry whole weights.

    Set by core when actor_train trains adapters with ``sync: adapter`` (or ``auto`` and a
    rollout strategy with the ``lora_adapter_sync`` capability). Before the first sync the
    adapters are zero: the engine generates with its base weights, as the trainer's zero-
    initialised ``B`` does."""
    args = worker.model_args.lora
    # Only actor_infer receives the policy's syncs; another role inheriting the top-level
    # model_args.lora (a reference on a rollout strategy) loads the plain base.
    if worker.role != "actor_infer" or args is None or args.sync != "adapter":
        return None
    return args


def lora_scaling(args: LoraArgs) -> float:
    """The factor of the adapters' product: ``W x + (alpha / rank) * B (A x)``."""
    return args.alpha / args.rank


def adapter_wire_name(name: str) -> str:
    """The name an adapter travels under in a sync: a trainer's state-dict name (after its own
    wrapper prefixes are stripped) ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.
    default.weight`` -> ``model.layers.0.self_attn.q_proj.lora_A.weight``: the HF name of the
    adapted module, then ``lora_A`` (shape ``(rank, in_features)``) or ``lora_B`` (``(out_
    features, rank)``), as peft's saved adapters name them without their prefix."""
    return name.removeprefix(_PEFT_PREFIX).replace(f".{LORA_ADAPTER}.", ".")


def parse_adapter_wire_name(name: str) -> tuple[str, str] | None:
    """``(HF module name, "A" or "B")`` of a synced adapter's name, None for any other name."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    return None


def wrap_lora(worker: WorkerContext, model: torch.nn.Module) -> Any:
    """``model`` with LoRA adapters on the targeted linears (base weights frozen); a target that
    is not a linear, or a linear whose weight is tied to another module's, is refused."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    args = _lora(worker)
    config = _peft_config(args)
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
            for m in lora_layers(peft_model).values()
            if not isinstance(m, LoraLinear)
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
    return peft_model


def _peft_config(args: LoraArgs) -> LoraConfig:
    """peft's config of ``model_args.lora``: what :func:`wrap_lora` adapts with and what
    :func:`write_lora_adapter` records."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,  # type: ignore[arg-type]  # peft annotates int; it scales a float
        lora_dropout=args.dropout,
        target_modules=list(args.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _lora(worker: WorkerContext) -> LoraArgs:
    args = worker.model_args.lora
    if args is None:  # a plugin's slip, not the user's: it checks lora_args first
        raise TypeError(f"role {worker.role} has no model_args.lora to build adapters from")
    return args


def _shared_adapted_weights(model: torch.nn.Module) -> list[str]:
    """Adapted modules whose base weight is also another module's (a tied output layer)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return sorted(
        name.removeprefix(_PEFT_PREFIX)
        for name, layer in lora_layers(model).items()
        if uses.get(id(layer.base_layer.weight), 0) > 1
    )


def lora_plain_name(name: str) -> str:
    """The HF name of a peft-wrapped parameter: ``base_model.model.model.layers.0.q_proj.
    base_layer.weight`` -> ``model.layers.0.q_proj.weight`` (a plain name is left as it is)."""
    return name.removeprefix(_PEFT_PREFIX).replace(_BASE_SEGMENT, ".")


def lora_base_model(model: torch.nn.Module) -> Any:
    """The HF model inside a peft wrapper (the model itself without one): what holds the HF
    config and ``save_pretrained`` of a merged export."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``{state-dict prefix: peft LoRA linear}`` of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_lora_adapter_entry(name: str) -> bool:
    """Whether a state-dict entry is an adapter (``lora_A`` / ``lora_B``), not a base weight."""
    return f".lora_A.{LORA_ADAPTER}." in name or f".lora_B.{LORA_ADAPTER}." in name


def lora_adapter_keys(prefix: str) -> tuple[str, str]:
    """The state-dict names of the ``A`` and ``B`` of the adapted module at ``prefix``."""
    return f"{prefix}.lora_A.{LORA_ADAPTER}.weight", f"{prefix}.lora_B.{LORA_ADAPTER}.weight"


def merge_lora_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: LoraLinear
) -> torch.Tensor:
    """``W + scale * B @ A`` in float32 (a new tensor: the trained model is untouched)."""
    delta = b.float() @ a.float()
    if layer.fan_in_fan_out:
        delta = delta.T
    return base.float() + layer.scaling[LORA_ADAPTER] * delta


def lora_record(worker: WorkerContext) -> dict:
    """What a checkpoint of adapters needs beside them: the base they adapt and their shape."""
    return {
        "base_model": worker.model_args.model_name_or_path,
        "lora": attrs.asdict(_lora(worker)),
    }


def check_lora_record(worker: WorkerContext, path: str, wanted: LoraArgs | None) -> None:
    """Refuse a checkpoint whose adapters are for another base or shape, or that holds full
    weights where adapters are expected (``wanted``: the role's adapters), or the other way
    round."""
    file = os.path.join(path, LORA_RECORD)
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
    current = lora_record(worker)
    for key in ("base_model", "lora"):
        if saved[key] != current[key]:
            raise CheckpointError(
                f"{path}: its adapters were trained with {key} {saved[key]!r}, this run has "
                f"{current[key]!r}; use the workflow that saved it"
            )


def write_lora_adapter(worker: WorkerContext, tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write the adapter in peft's format (``PeftModel.from_pretrained(base, path)`` loads it):
    ``tensors`` are the gathered adapters under peft's state-dict names
    (``base_model.model.<module>.lora_A.default.weight``); the config is ``model_args.lora``'s,
    recording the run's base where peft can load it (a preset's or a relative path's directory,
    a hub id as given), so ``AutoPeftModelForCausalLM.from_pretrained(path)`` needs nothing
    else. Called on rank 0."""
    from safetensors.torch import save_file

    from posttrain.backends.models import resolve_model_path

    os.makedirs(path, exist_ok=True)
    saved = {name.replace(f".{LORA_ADAPTER}.", "."): t for name, t in tensors.items()}
    save_file(saved, os.path.join(path, "adapter_model.safetensors"))
    config = _peft_config(_lora(worker)).to_dict()
    # peft reads "preset:NAME" as a hub id and fails: the preset's directory is what it loads.
    base = resolve_model_path(worker.model_args.model_name_or_path, worker.base_dir)
    config["base_model_name_or_path"] = os.path.abspath(base) if os.path.exists(base) else base
    config["target_modules"] = sorted(config["target_modules"])
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, default=sorted)
