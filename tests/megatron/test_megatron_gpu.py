"""megatron_train on CUDA GPUs with NCCL (skipped without): the conformance kit at TP2 and at
CP2, and an MoE training smoke test at EP2 with the alltoall token dispatcher (which needs CUDA).

Run on the GPU machine: ``python -m pytest -m gpu tests/megatron/test_megatron_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.testing import StrategyContract

GPUS = torch.cuda.device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.timeout(600),
]


class TestMegatronTrainTP2ContractCUDA(StrategyContract):
    strategy = "megatron_train"
    strategy_config = {"tensor_model_parallel_size": 2}
    world_size = 2
    device = "cuda"


class TestMegatronTrainCP2ContractCUDA(StrategyContract):
    strategy = "megatron_train"
    strategy_config = {"context_parallel_size": 2}
    world_size = 2
    device = "cuda"


def export_all(group) -> dict[str, torch.Tensor]:
    """Every exported HF-named tensor (collective export; rank 0 holds them)."""
    group.call("export_begin", 64 << 10)
    state: dict[str, torch.Tensor] = {}
    while (bucket := group.call("export_next")[0]) is not None:
        for name, tensor in bucket.tensors:
            assert name not in state, name
            state[name] = tensor.clone()
    return state


def moe_training_smoke(tmp_path, device: str, dispatcher: str, ep: int = 2) -> None:
    """megatron_train on a tiny Qwen3-MoE at EP2 (DP2 for the dense part): the export right after
    loading equals the HF checkpoint (names, dtypes, values); two steps give finite metrics and
    move the weights, experts on both EP ranks included; the export keeps the HF names."""
    from megatron_workers import build_hf_model
    from safetensors.torch import load_file

    from posttrain.config.sections import (
        AlgorithmConfig,
        ModelArgs,
        RoleConfig,
        StrategyArgs,
        TrainingArgs,
    )
    from posttrain.launch.base import GroupSpec
    from posttrain.launch.local import LocalLauncher
    from posttrain.testing.expected import synthetic_train_batch
    from posttrain_megatron.config import MegatronTrainConfig

    model = build_hf_model(str(tmp_path / "qwen3_moe"), "qwen3_moe")
    config = MegatronTrainConfig(
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
        micro_batch_size=2,
    )
    role = RoleConfig(
        strategy_args=StrategyArgs(strategy_name="megatron_train", strategy_config=config),
        device_mapping=(0, 1),
        model_args=ModelArgs(model_name_or_path=model),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0),
    )
    launcher = LocalLauncher(call_timeout_s=300, start_timeout_s=300)
    try:
        group = launcher.start_group(
            GroupSpec(
                role="actor_train",
                config=role,
                algorithm=AlgorithmConfig(),
                seed=1234,
                run_dir=str(tmp_path / "run"),
                base_dir=str(tmp_path),
                device=device,
                threads=1,
            )
        )
        assert group.dp_size == 2
        expected = load_file(f"{model}/model.safetensors")
        before = export_all(group)
        assert set(before) == set(expected)
        for name, tensor in expected.items():
            assert before[name].dtype == tensor.dtype, name
            assert torch.equal(before[name], tensor), name

        for seed in range(2):
            batch = synthetic_train_batch(seed=seed, dp_size=group.dp_size)
            metrics = group.call_dp("train_step", batch.split(group.dp_size))
            for share in metrics:
                assert share, "train_step returned no metrics"
                assert all(math.isfinite(v) for v in share.values()), share
            assert metrics[0]["actor/grad_norm"] > 0

        after = export_all(group)
        assert set(after) == set(expected)
        assert all(after[k].shape == expected[k].shape for k in expected)
        moved = {k for k in expected if not torch.equal(after[k], before[k])}
        for layer in range(2):
            for expert in range(4):  # experts 0-1 live on EP rank 0, 2-3 on EP rank 1
                name = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
                assert name in moved, name
            assert f"model.layers.{layer}.mlp.gate.weight" in moved
        assert "model.embed_tokens.weight" in moved and "lm_head.weight" in moved
    finally:
        launcher.shutdown()


def test_moe_ep2_alltoall_trains_and_exports(tmp_path):
    moe_training_smoke(tmp_path, device="cuda", dispatcher="alltoall")


def gpu_allocated_mib(runtime) -> float:
    """Run on a rank (``run_function``): memory its tensors hold on the GPU."""
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def _start_group(launcher, tmp_path, model: str, name: str):
    from posttrain.config.sections import (
        AlgorithmConfig,
        ModelArgs,
        RoleConfig,
        StrategyArgs,
        TrainingArgs,
    )
    from posttrain.launch.base import GroupSpec
    from posttrain_megatron.config import MegatronTrainConfig

    # The offloads that make release_memory move state to the host (off by default).
    config = MegatronTrainConfig(
        use_distributed_optimizer=True,
        micro_batch_size=2,
        param_offload=True,
        grad_offload=True,
        optimizer_offload=True,
    )
    role = RoleConfig(
        strategy_args=StrategyArgs(strategy_name="megatron_train", strategy_config=config),
        device_mapping=(0, 1),
        model_args=ModelArgs(model_name_or_path=model),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0),
    )
    spec = GroupSpec(
        role="actor_train",
        config=role,
        algorithm=AlgorithmConfig(),
        seed=1234,
        run_dir=str(tmp_path / name),
        base_dir=str(tmp_path),
        device="cuda",
        threads=1,
    )
    return launcher.start_group(spec)


def test_release_and_resume_memory_frees_the_gpu_and_changes_nothing(tmp_path):
    """Colocated time-sharing: weights, grads and optimizer state go to the host and come back;
    the GPU is nearly empty in between and training continues exactly as without it."""
    from megatron_workers import build_hf_model

    from posttrain.launch.local import LocalLauncher
    from posttrain.testing.expected import synthetic_train_batch

    model = build_hf_model(str(tmp_path / "qwen2"), "qwen2")
    results = {}
    for name, release in (("plain", False), ("released", True)):
        launcher = LocalLauncher(call_timeout_s=300, start_timeout_s=300)
        try:
            group = _start_group(launcher, tmp_path, model, name)
            for seed in range(2):
                batch = synthetic_train_batch(seed=seed, dp_size=group.dp_size)
                group.call_dp("train_step", batch.split(group.dp_size))
                if release and seed == 0:
                    held = group.call("run_function", f"{__name__}:gpu_allocated_mib")[0]
                    group.call("release_memory", ["weights", "grads", "optimizer"])
                    left = group.call("run_function", f"{__name__}:gpu_allocated_mib")[0]
                    group.call("resume_memory", ["weights", "grads", "optimizer"])
            results[name] = export_all(group)
        finally:
            launcher.shutdown()
    # What is left is not model state (cuBLAS workspaces and the like, ~64 MiB); what went is at
    # least the fp32 weights and their grads (Adam's moments, sharded, come on top).
    from safetensors.torch import load_file

    numel = sum(t.numel() for t in load_file(f"{model}/model.safetensors").values())
    assert (held - left) * 2**20 >= 0.9 * numel * 4 * 2, (held, left, numel)
    for key, tensor in results["plain"].items():
        assert torch.equal(tensor, results["released"][key]), key
