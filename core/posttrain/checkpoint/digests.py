"""sha256 of checkpoint files computed while they are written, so that no second read pass over
everything a save wrote is needed before the manifest can list their checksums."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO


class HashingStream:
    """A write-only file wrapper: every byte written also goes into a sha256.

    Offers what torch's serialisers and DCP's file writer use (``write``, ``tell``, ``flush``,
    ``fileno``); seeking would make the digest wrong, so it is not offered."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self._digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        # Buffered files write everything or raise; the digest then matches the file exactly.
        self._digest.update(data)
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class FileDigests:
    """The digests of the files one rank wrote under ``root``; writer threads record into it."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self._lock = threading.Lock()
        self._by_path: dict[str, str] = {}

    def record(self, path: str | os.PathLike, digest: str) -> None:
        with self._lock:
            self._by_path[os.path.abspath(path)] = digest

    def renamed(self, old: str | os.PathLike, new: str | os.PathLike) -> None:
        with self._lock:
            digest = self._by_path.pop(os.path.abspath(old), None)
            if digest is not None:
                self._by_path[os.path.abspath(new)] = digest

    def relative(self) -> dict[str, str]:
        """``{path relative to root: sha256}`` for the recorded files that exist now."""
        with self._lock:
            items = list(self._by_path.items())
        return {
            os.path.relpath(path, self.root): digest
            for path, digest in items
            if os.path.isfile(path)
        }

    @contextmanager
    def open(self, path: str) -> Iterator[HashingStream]:
        """A new file at ``path``: hashed while written, fsynced and recorded when closed.
        A failed write records nothing (the file then gets no trusted digest)."""
        with open(path, "wb") as raw:
            stream = HashingStream(raw)
            yield stream
            raw.flush()
            os.fsync(raw.fileno())
        self.record(path, stream.hexdigest())
