"""Background checkpoint pieces: digests computed while writing, the completion marker, the
manifest built without reading back what was hashed, bounded host buffers, and old checkpoints
retired only after the new one is complete."""

import hashlib
import os

import pytest
import torch

from posttrain.checkpoint import host_buffers, manager, manifest
from posttrain.checkpoint.background import BackgroundSave, read_marker
from posttrain.errors import CheckpointError


def test_digest_while_writing_matches_a_read_back(tmp_path):
    save = BackgroundSave(str(tmp_path), rank=3)
    payload = {"w": torch.arange(1000, dtype=torch.float32)}

    def write():
        with save.digests.open(str(tmp_path / "state.pt")) as f:
            torch.save(payload, f)

    save.start(write)
    save.join()
    marker = read_marker(str(tmp_path), 3)
    assert marker["error"] is None
    assert marker["files"] == {"state.pt": manifest.sha256_file(str(tmp_path / "state.pt"))}


def test_failed_background_write_is_reported_by_marker_and_join(tmp_path):
    save = BackgroundSave(str(tmp_path), rank=0)
    save.start(lambda: open(tmp_path / "missing-dir" / "f", "wb"))  # noqa: SIM115
    with pytest.raises(CheckpointError, match="rank 0"):
        save.join()
    assert "FileNotFoundError" in read_marker(str(tmp_path), 0)["error"]


def test_finalize_reads_back_only_files_without_a_digest(tmp_path, monkeypatch):
    tmp = manager.temp_dir(str(tmp_path), 7)
    os.makedirs(os.path.join(tmp, "actor_train"))
    hashed, unhashed = b"a" * 5000, b"b" * 300
    with open(os.path.join(tmp, "actor_train", "hashed.bin"), "wb") as f:
        f.write(hashed)
    with open(os.path.join(tmp, "actor_train", "metadata.json"), "wb") as f:
        f.write(unhashed)
    known = manager.write_driver_files(tmp, b'{"step": 7}', b"workflow: {}")
    known["actor_train/hashed.bin"] = hashlib.sha256(hashed).hexdigest()
    read = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: read.append(p) or real(p))
    path, written = manager.finalize_checkpoint(str(tmp_path), 7, tmp, {}, {}, known=known)
    assert [os.path.basename(p) for p in read] == ["metadata.json"]
    assert manifest.verify(path).files == written.files


def test_old_checkpoints_are_retired_after_the_new_one_is_complete(tmp_path, monkeypatch):
    for step in (1, 2):
        manager.save_checkpoint(str(tmp_path), step, lambda tmp: {}, {"step": step}, {}, 2)
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    manager.save_checkpoint(str(tmp_path), 3, lambda tmp: {}, {"step": 3}, {}, 2)
    assert seen == [
        (".checkpoint-3.tmp", "checkpoint-3"),  # complete first
        ("checkpoint-1", ".checkpoint-1.tmp-old"),  # then out of sight, then removed
    ]
    assert [s for s, _ in manager.checkpoint_dirs(str(tmp_path))] == [2, 3]


def test_host_buffers_are_sized_once_and_refuse_with_figures(monkeypatch):
    buffers = host_buffers.HostBuffers("actor_train rank 0", pin=False)
    state = {"a": torch.ones(256), "b": torch.zeros(4, 4, dtype=torch.bfloat16)}
    buffers.reserve(state.items())
    first = {k: buffers.copy(k, t) for k, t in state.items()}
    state["a"].add_(1)
    buffers.reserve(state.items())
    again = buffers.copy("a", state["a"])
    assert again.data_ptr() == first["a"].data_ptr() and torch.equal(again, state["a"])
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: 2 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(CheckpointError) as err:
        buffers.reserve([("big", torch.empty(2**28, device="meta"))])  # 1 GiB of float32
    text = str(err.value)
    assert "1.00 GiB more" in text and "8 ranks" in text and "8.00 GiB" in text
    assert "2.00 GiB of memory is available" in text
