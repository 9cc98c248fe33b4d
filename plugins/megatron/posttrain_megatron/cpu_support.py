"""CPU support for megatron-core (test support; applied only when the rank has no GPU).

megatron-core assumes CUDA in places that have nothing to do with the computation: it moves
modules with ``.cuda()``, allocates scratch tensors with ``device="cuda"``, compares
``tensor.type()`` with ``"torch.cuda.FloatTensor"``, keeps a CUDA RNG tracker for dropout and
calls ``torch.cuda.synchronize``/``current_device``. On a CPU-only rank (CI, tests, the CPU
quickstart) :func:`apply` maps all of that onto the CPU:

* a :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` arguments, ``.cuda()``
  and ``.to("cuda")`` to the CPU, drops ``pin_memory=True`` (host staging for a CUDA copy), and
  answers ``tensor.type()`` with the CUDA type name;
* the mode is active during backward passes too (a mode is switched off while its own handler
  runs, and ``loss.backward()`` passes through that handler), so megatron's backward functions
  allocate on the CPU as well;
* ``torch.nn.Module.cuda`` returns the module unchanged;
* ``torch.cuda.current_device`` / ``synchronize`` / RNG calls act on the CPU device and RNG, so
  megatron's RNG tracker forks the CPU generator; CUDA streams are torch's CPU streams (in order).

Nothing here changes what is computed: every kernel is torch's CPU kernel. On a rank with a GPU
:func:`apply` is never called. :data:`PATCHED_INTERNALS` lists the megatron-core internals these
patches stand in for; ``tests/megatron/test_megatron_config.py`` fails loudly when one disappears
from the installed megatron-core, so a new release cannot silently bypass them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from typing import Any, ParamSpec, TypeVar

import torch
from torch.overrides import TorchFunctionMode

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger(__name__)

# (module, attribute) pairs in megatron-core whose CUDA assumptions the patches below cover.
PATCHED_INTERNALS: tuple[tuple[str, str], ...] = (
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("torch.autograd", "_engine_run_backward"),
)

_applied = False


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpu(TorchFunctionMode):
    """Runs calls that name a CUDA device on the CPU instead."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # host staging for a CUDA copy (e.g. CP rotary indices)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cpu_rng_state(*args: object, **kwargs: object) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args: object, **kwargs: object) -> None:
    torch.set_rng_state(state)


def _with_cpu_mode(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with CudaToCpu():
            return fn(*args, **kwargs)

    return wrapper


def apply() -> None:
    """Install the CPU patches in this process (idempotent). Call before building models."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("posttrain_megatron.cpu_support is for ranks without a GPU")
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    # MoE dispatchers and shared experts overlap work on side streams: torch's CPU streams are
    # the same API, run in order.
    torch.cuda.Stream = torch.cpu.Stream
    torch.cuda.current_stream = torch.cpu.current_stream
    torch.cuda.stream = torch.cpu.stream
    torch.nn.Module.cuda = lambda self, device=None: self
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # backward() and autograd.grad() run the engine from inside the mode's handler, where the
    # mode is off: run the engine (and with it every backward function) under the mode again.
    torch.autograd._engine_run_backward = _with_cpu_mode(torch.autograd._engine_run_backward)
    # Process-wide: the mode stays pushed for the life of this rank.
    CudaToCpu().__enter__()
    _applied = True
    log.debug("megatron: CPU support patches applied")
