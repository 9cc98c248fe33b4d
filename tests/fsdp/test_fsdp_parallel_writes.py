"""DCP with several writer threads (large states): every file's digest, taken while written,
equals a read-back sha256, and the state loads back exactly."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed.checkpoint as dcp

from posttrain.checkpoint.digests import FileDigests
from posttrain_fsdp.engine import _hashing_writer


def test_parallel_writers_hash_every_file_while_writing(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 256, generator=gen) for i in range(8)}
    digests = FileDigests(str(tmp_path))
    dcp.save(state, storage_writer=_hashing_writer(str(tmp_path / "dcp"), digests, threads=3))
    recorded = digests.relative()
    data_files = [p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp"]
    assert len(data_files) == 3  # one per writer thread
    for path in (tmp_path / "dcp").iterdir():
        name = str(path.relative_to(tmp_path))
        assert recorded[name] == hashlib.sha256(path.read_bytes()).hexdigest(), name
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
