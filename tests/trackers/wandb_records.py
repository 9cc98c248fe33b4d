"""Reads a W&B offline run file (``run-ID.wandb``) back: the history rows and the run's record.

wandb 0.31 no longer ships a Python reader of these files (``wandb.sdk.internal.datastore`` is
gone; its Go core writes them). The framing is LevelDB's log format behind a 7-byte W&B
header; each record is decoded with wandb's own protobuf, ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B"
HEADER_BYTES = 7  # ident, magic (0xBEE1), version
BLOCK = 32768
RECORD_HEADER = 7  # crc32c, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == HEADER, f"{path} is not a W&B run file"
    pos, pieces = HEADER_BYTES, b""
    while pos + RECORD_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        payload = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == FULL:
            pieces = payload
        elif kind == FIRST:
            pieces = payload
            continue
        elif kind == MIDDLE:
            pieces += payload
            continue
        elif kind == LAST:
            pieces += payload
        else:  # zeros after the last record
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pieces)
        yield record


def history(path: Path) -> list[dict]:
    """Every history row of the file, ``{metric: value}`` with ``_step``."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def run_record(path: Path) -> wandb_internal_pb2.RunRecord:
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def config(path: Path) -> dict:
    """The run's config as the file holds it (the run record's, then later updates)."""
    found: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        update = record.run.config if kind == "run" else record.config if kind == "config" else None
        if update is not None:
            for item in update.update:
                found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return found
