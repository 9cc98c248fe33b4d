"""deepspeed_train (examples/quickstart_deepspeed.yaml: ZeRO-2 on 2 ranks, hybrid layout) killed
with SIGKILL between checkpoints resumes with ``resume: auto`` and ends bitwise equal to an
uninterrupted run: every tensor of DeepSpeed's checkpoint (weights, fp32 optimizer partitions,
Adam moments, scheduler) and every step's reward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    kill_after_checkpoint,
    read_metrics,
    run_quickstart,
    small_run,
)

pytest.importorskip("posttrain_deepspeed")

WORKFLOW = REPO / "examples" / "quickstart_deepspeed.yaml"
SMALL = small_run(max_steps=10, save_steps=3)


def tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a (nested) checkpoint object, by its path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found.update(tensors(item, f"{prefix}/{key}"))
    return found


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    role = run_dir / "checkpoint-10" / "actor_train"
    files = sorted(role.rglob("*.pt"))
    assert any(f.name.endswith("optim_states.pt") for f in files), files
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(tensors(torch.load(file, weights_only=False), str(file.relative_to(role))))
    return state


def rewards_by_step(run_dir: Path) -> dict[int, float]:
    # A resumed run appends: the later line of a step wins, as it does in the checkpoint.
    return {m["step"]: m["reward/mean"] for m in read_metrics(run_dir)}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_between_checkpoints_then_resume(tmp_path, e2e_cache):
    reference = tmp_path / "uninterrupted"
    run_quickstart(reference, *SMALL, workflow=WORKFLOW)

    run_dir = tmp_path / "killed"
    kill_after_checkpoint(WORKFLOW, run_dir, *SMALL)
    run_quickstart(run_dir, *SMALL, workflow=WORKFLOW)

    assert rewards_by_step(run_dir) == rewards_by_step(reference)
    got, expected = final_state(run_dir), final_state(reference)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
