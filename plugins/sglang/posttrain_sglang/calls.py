"""SGLang's weight-update calls, each bounded by a timeout.

``Engine``'s own methods wait on its event loop without a limit, and SGLang makes its weight-update
group with torch's default timeout (30 minutes): a trainer that dies or stalls in the middle of a
broadcast would hang the rollout rank that long (with NCCL, for ever). These functions send the
same requests as ``Engine.init_weights_update_group`` & co. through the engine's tokenizer
manager, under ``asyncio.wait_for``. After a timeout the scheduler may still be blocked in the
collective, so the engine is marked unusable: every later call fails at once with the reason,
and shutdown kills its processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from posttrain import PosttrainError
from posttrain_sglang.state import rank_state

if TYPE_CHECKING:
    import torch
    from sglang.srt.entrypoints.engine import Engine

    from posttrain import WorkerContext

# A broadcast bucket's tensors: name, shape, dtype name and bytes each, in the bucket's order.
BucketMeta = Sequence[tuple[str, Sequence[int], str, int]]

log = logging.getLogger("posttrain.sglang")


class EngineCallFailed(PosttrainError):
    """An SGLang call answered with failure, or did not answer in time."""


def check_usable(worker: WorkerContext) -> None:
    reason = rank_state(worker).broken
    if reason:
        raise EngineCallFailed(f"sglang: the engine is unusable since an earlier failure: {reason}")


def bounded(
    worker: WorkerContext,
    engine: Engine,
    method: str,
    request: Any,
    timeout_s: float,
    what: str,
    peer: bool = False,
) -> tuple[bool, str]:
    """``await engine.tokenizer_manager.<method>(request)`` for at most ``timeout_s``; ``peer``:
    the call waits for the trainer side of a broadcast."""
    check_usable(worker)
    coro = getattr(engine.tokenizer_manager, method)(request, None)
    try:
        return engine.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))
    except TimeoutError:
        cause = "the trainer side of the weight sync" if peer else "SGLang's scheduler"
        reason = f"{what} did not finish within {timeout_s:.0f}s (is {cause} gone or stuck?)"
        rank_state(worker).broken = reason
        raise EngineCallFailed(f"sglang: {reason}") from None


def _ok(answer: tuple[bool, str], what: str) -> None:
    """SGLang answers ``(success, message)``; a failure becomes an error with its message."""
    success, message = answer[0], answer[1]
    if not success:
        raise EngineCallFailed(f"sglang: {what} failed: {message}")


@contextmanager
def weight_update(worker: WorkerContext, engine: Engine, timeout_s: float) -> Iterator[None]:
    """``begin_weight_update`` ... ``end_weight_update``: SGLang 0.5.23 refuses tensor and
    distributed updates outside such a session."""
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

    what = "begin_weight_update"
    _ok(bounded(worker, engine, what, BeginWeightUpdateReqInput(), timeout_s, what), what)
    try:
        yield
    except BaseException:
        # Close the session after a failed load too, so that a retry can open one (the
        # weights are then undefined until a complete sync); not after a timeout: the scheduler
        # may still sit in the collective. The load's own error is the one to report.
        if not rank_state(worker).broken:
            try:
                _end(worker, engine, timeout_s)
            except EngineCallFailed as exc:
                log.warning("closing the weight-update session after a failure: %s", exc)
        raise
    _end(worker, engine, timeout_s)


def _end(worker: WorkerContext, engine: Engine, timeout_s: float) -> None:
    from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

    what = "end_weight_update"
    _ok(bounded(worker, engine, what, EndWeightUpdateReqInput(), timeout_s, what), what)


# Every update asks the scheduler to flush its cache right after loading (cached prefixes hold
# keys/values of the old weights; SGLang fails the update if requests are still running).
# Without the allocator pass: on CPU that is a gc.collect() of ~0.5-1 s per call.
_FLUSH = {"flush_cache": True, "torch_empty_cache": False}


def flush_cache(worker: WorkerContext, engine: Engine) -> None:
    check_usable(worker)
    result = engine.flush_cache()
    if not getattr(result, "success", True):
        raise EngineCallFailed(f"sglang: flush_cache failed: {result.message}")


def update_from_tensors(
    worker: WorkerContext,
    engine: Engine,
    tensors: list[tuple[str, torch.Tensor]],
    timeout_s: float,
) -> None:
    """Load ``(name, tensor)`` pairs: CUDA tensors travel to the scheduler as IPC handles, host
    tensors as shared memory."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    tensors = [(name, _shareable(t)) for name, t in tensors]
    payload = [MultiprocessingSerializer.serialize(tensors) for _ in range(worker.config.tp_size)]
    request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, **_FLUSH)
    what = "update_weights_from_tensor"
    _ok(bounded(worker, engine, what, request, timeout_s, what), what)


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    """Pickling a host tensor moves its storage into shared memory in place: a tensor the
    trainer still owns (in-process hand-over) is copied there instead, once, as the move would."""
    if tensor.is_cuda or tensor.is_shared():
        return tensor
    import torch

    return torch.empty_like(tensor).share_memory_().copy_(tensor)


def init_group(
    worker: WorkerContext,
    engine: Engine,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    group: str,
    backend: str,
    timeout_s: float,
) -> None:
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    request = InitWeightsUpdateGroupReqInput(
        master_address=address,
        master_port=port,
        rank_offset=rank,
        world_size=world_size,
        group_name=group,
        backend=backend,
    )
    what = "init_weights_update_group"
    _ok(bounded(worker, engine, what, request, timeout_s, f"{what} ({group})", peer=True), what)


def update_from_distributed(
    worker: WorkerContext, engine: Engine, meta: BucketMeta, group: str, timeout_s: float
) -> None:
    """Receive one bucket broadcast as SGLang's ``flattened_bucket`` (the core's wire format:
    one uint8 tensor, the tensors' bytes in metadata order) and load it."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    request = UpdateWeightsFromDistributedReqInput(
        names=[name for name, *_ in meta],
        dtypes=[dtype for _, _, dtype, _ in meta],
        shapes=[list(shape) for _, shape, _, _ in meta],
        group_name=group,
        load_format="flattened_bucket",
        **_FLUSH,
    )
    what = "update_weights_from_distributed"
    _ok(bounded(worker, engine, what, request, timeout_s, f"{what} ({group})", peer=True), what)


def destroy_group(worker: WorkerContext, engine: Engine, group: str, timeout_s: float) -> None:
    from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

    what = "destroy_weights_update_group"
    request = DestroyWeightsUpdateGroupReqInput(group_name=group)
    _ok(bounded(worker, engine, what, request, timeout_s, what), what)
