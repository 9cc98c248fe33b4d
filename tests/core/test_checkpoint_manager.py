"""The checkpoint manager: atomic writes, manifests with checksums, refusal of corrupted files."""

import os

import pytest

from posttrain.checkpoint import manager
from posttrain.checkpoint.manifest import verify
from posttrain.errors import CheckpointError


def write_roles(tmp: str) -> dict:
    os.makedirs(os.path.join(tmp, "actor_train"))
    with open(os.path.join(tmp, "actor_train", "weights.bin"), "wb") as f:
        f.write(os.urandom(4096))
    return {"actor_train": {"strategy": "fake", "world_size": 1}}


def save(run_dir, step, roles=write_roles, limit=None):
    return manager.save_checkpoint(
        str(run_dir), step, roles, {"step": step, "sampler": {}}, {"posttrain": "0"}, limit
    )


def test_saved_checkpoint_has_manifest_with_checksums(tmp_path):
    path = save(tmp_path, 3)
    manifest = verify(path)
    assert manifest.step == 3
    assert set(manifest.files) == {"actor_train/weights.bin", "driver_state.json", "workflow.yaml"}
    assert manager.latest_checkpoint(str(tmp_path)) == path
    state = manager.load_driver_state(path)[1]
    assert state["step"] == 3


def test_crash_while_saving_leaves_no_complete_looking_checkpoint(tmp_path):
    save(tmp_path, 2)

    def crash(tmp):
        write_roles(tmp)
        raise KeyboardInterrupt  # stands for the process dying mid-write

    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, roles=crash)
    assert manager.latest_checkpoint(str(tmp_path)).endswith("checkpoint-2")
    assert os.path.isdir(tmp_path / ".checkpoint-4.tmp")
    manager.remove_stale_temporaries(str(tmp_path))
    assert not os.path.exists(tmp_path / ".checkpoint-4.tmp")


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_file_is_refused_with_its_name(tmp_path, damage):
    path = save(tmp_path, 1)
    target = os.path.join(path, "actor_train", "weights.bin")
    if damage == "flip":
        with open(target, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(target, 100)
    else:
        os.remove(target)
    with pytest.raises(CheckpointError, match=r"actor_train/weights\.bin"):
        manager.load_driver_state(path)


def test_missing_or_broken_manifest_is_refused(tmp_path):
    path = save(tmp_path, 1)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        verify(path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        verify(path)


def test_total_limit_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, limit=2)
    assert [s for s, _ in manager.checkpoint_dirs(str(tmp_path))] == [3, 4]


def test_resaving_a_step_replaces_it_whole(tmp_path):
    first = save(tmp_path, 5)
    again = save(tmp_path, 5)
    assert first == again
    verify(again)
    assert not any(n.startswith(".checkpoint") for n in os.listdir(tmp_path))
