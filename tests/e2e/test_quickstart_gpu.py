"""The quickstart on CUDA GPUs: fsdp2_train over NCCL, colocated roles time-sharing the devices
through the memory-lifecycle hooks (skipped without a GPU)."""

import pytest
import torch
from conftest import read_metrics, run_quickstart


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(900)
def test_quickstart_learns_on_gpus(tmp_path, e2e_cache):
    run_dir = tmp_path / "run"
    run_quickstart(
        run_dir,
        "--set",
        "trainer.resume=never",
        "--set",
        "trainer.logger=[jsonl]",
        "--set",
        "cluster.device=cuda",
        timeout=880,
    )
    rewards = [m["reward/mean"] for m in read_metrics(run_dir)]
    assert sum(rewards[-10:]) / 10 >= 0.8
