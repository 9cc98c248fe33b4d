"""Host buffers that a rank's checkpoint state is copied into before it is written in the
background: allocated at the first save (pinned when the state lives on a GPU, so the copy runs
at full PCIe speed) and reused by every later save, so host memory stays bounded."""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable

import torch

from posttrain.errors import CheckpointError

GiB = 2**30


def available_host_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo; None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostBuffers:
    """One host tensor per state entry (``key``), sized at the first save and reused."""

    def __init__(self, owner: str, pin: bool):
        self.owner = owner  # named in errors: "actor_train rank 0"
        self.pin = pin
        self._buffers: dict[Hashable, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _fits(self, buffer: torch.Tensor | None, like: torch.Tensor) -> bool:
        return buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype

    def reserve(self, entries: Iterable[tuple[Hashable, torch.Tensor]]) -> None:
        """Allocate the buffers the entries still lack, after checking that they fit in the
        host's available memory (every rank on this host allocates alike): a save that would
        not fit is refused with figures before anything is copied or written."""
        missing = [(k, t) for k, t in entries if not self._fits(self._buffers.get(k), t)]
        need = sum(t.numel() * t.element_size() for _, t in missing)
        if not need:
            return
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        available = available_host_bytes()
        # Keep a margin for the rest of the process (allocator slack, the writer's own buffers).
        if available is not None and need * local_ranks > 0.9 * available:
            raise CheckpointError(
                f"{self.owner}: an asynchronous checkpoint needs {need / GiB:.2f} GiB more host "
                f"buffers on each of the {local_ranks} ranks of this host "
                f"({need * local_ranks / GiB:.2f} GiB, {self.nbytes / GiB:.2f} GiB already held "
                f"per rank), but only {available / GiB:.2f} GiB of memory is available "
                "(MemAvailable); use more ranks, or trainer.async_save: false to save "
                "synchronously without host buffers"
            )
        for key, like in missing:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
            self._buffers[key] = buffer.pin_memory() if self.pin else buffer

    def copy(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in its reserved buffer; device copies are asynchronous until
        :meth:`synchronize`."""
        buffer = self._buffers[key]
        buffer.copy_(tensor.detach(), non_blocking=self.pin)
        return buffer

    def synchronize(self) -> None:
        if self.pin:
            torch.cuda.synchronize()


# A rank's state at least this large is written by several threads at once (one file each):
# one thread that serialises, hashes and writes keeps well under a disk's speed.
PARALLEL_WRITE_BYTES = 1 << 30


def write_threads(state_bytes: int) -> int:
    """Writer threads for a rank's save of ``state_bytes``: 1 for small states (their file
    layout and the order of their writes stay fixed), up to 4 for large ones."""
    import os

    if state_bytes < PARALLEL_WRITE_BYTES:
        return 1
    return max(1, min(4, os.cpu_count() or 1))
