"""Fixes for the megatron-core / mbridge releases this plugin supports (CPU and GPU alike).

* megatron-core 0.16.1's MoE router reads a module global ``te_general_gemm`` that is only
  defined when TransformerEngine imports; without TE the router raises ``NameError``. Defining
  it as None selects the router's own torch path, which is what the code intends without TE.
* megatron-core 0.19 dropped ``ModelType.encoder_and_decoder``; mbridge 0.15.1's ``get_model``
  still compares with it (``AttributeError`` on every model build). mbridge's module gets a
  ``ModelType`` whose ``encoder_and_decoder`` matches nothing (decoder-only models, as intended).
* Without apex / TransformerEngine, megatron-core's optimizer falls back to per-tensor loops for
  apex's fused multi-tensor ops: the gradient norm reads every tensor's norm to the host (one
  device sync per parameter) and scaling / copying builds a temporary per tensor (``dst.copy_(src
  * scale)``, also for the fp32 -> bf16 copy of the main params after each step). On one H200
  with a 1.5B model that is milliseconds per step. The same ops on torch's multi-tensor
  ``_foreach`` kernels replace them (same results up to summation order of the norm).
* Asynchronous dist-checkpoint saves: megatron-core 0.19 defaults ``async_strategy`` to
  ``nvrx`` (nvidia-resiliency-ext, not installed here); its own ``mcore`` path is what 0.16.1
  always uses. The DCP item writer's signature (transforms, serialisation format) differs
  between torch releases, as megatron's own writer notes.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _mbridge_model_type()
    _foreach_multi_tensor_ops()


def _foreach_multi_tensor_ops() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_multi_tensor_scale
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_multi_tensor_l2_norm


def foreach_multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    scale: float,
) -> None:
    """``dst = src * scale`` for each pair (apex's ``multi_tensor_scale`` contract)."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def foreach_multi_tensor_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args: object,
) -> tuple[torch.Tensor, None]:
    """The l2 norm over every tensor as a float32 [1] tensor on their device (apex's
    ``multi_tensor_l2norm`` contract, without per-tensor norms), no host sync."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.zeros(1, dtype=torch.float32, device=device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)])
    return torch.linalg.vector_norm(norms).reshape(1), None


def _mbridge_model_type() -> None:
    from megatron.core.transformer.enums import ModelType

    if "encoder_and_decoder" in vars(ModelType):  # megatron-core < 0.19
        return
    from mbridge.core import util as mbridge_util

    mbridge_util.ModelType = types.SimpleNamespace(
        encoder_or_decoder=ModelType.encoder_or_decoder, encoder_and_decoder=object()
    )


def async_dist_save(sharded_state: dict[str, Any], target: str) -> AsyncRequest:
    """``dist_checkpointing.save(..., async_sharded_save=True)``: the AsyncRequest whose
    ``async_fn_args`` are ``(rank, write_buckets, results_queue)`` and whose ``finalize_fns``
    are collective."""
    from megatron.core import dist_checkpointing

    extra = {}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        extra["async_strategy"] = "mcore"
    return dist_checkpointing.save(sharded_state, target, async_sharded_save=True, **extra)


def dcp_write_item() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """torch's DCP item writer with the leading arguments and keywords this torch expects."""
    from torch.distributed.checkpoint import filesystem

    params = inspect.signature(filesystem._write_item).parameters
    lead = (filesystem._StorageWriterTransforms(),) if "transforms" in params else ()
    extra = {}
    if "serialization_format" in params:
        extra["serialization_format"] = filesystem.SerializationFormat.TORCH_SAVE
    return filesystem._write_item, lead, extra
