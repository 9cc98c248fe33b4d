"""A trainer on 2 ranks -> weight sync -> vllm: rollout log-probs equal the trainer's.

fsdp2_train, with the in-process engine and with vLLM's multiprocessing engine (tensors cannot
cross its RPC, so the plugin goes through safetensors in tmpfs there); fsdp2_train training LoRA
adapters (vLLM receives the merged weights under the plain HF names); megatron_train at TP2
(its export gathers the TP shards into HF-named buckets), in-process.
"""

from __future__ import annotations

import os
import time

import attrs
import pytest

from posttrain.config.sections import LoraArgs
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import GenerationRequest, RolloutSamples, SamplingParams
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import max_sample_logprob_diff, samples_batch, synthetic_train_batch
from posttrain.testing.groups import descendants, engine_processes, group_spec

pytest.importorskip("posttrain_fsdp")

TOLERANCE = 1e-4


def _spec(strategy, raw, ranks, role, model_path, tmp_path, env=None):
    return group_spec(
        strategy, raw, ranks, role, model_path, tmp_path / "run", base_dir=tmp_path, env=env
    )


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("posttrain-vllm-")}


def _have_megatron() -> bool:
    import importlib.util

    return importlib.util.find_spec("posttrain_megatron") is not None


def _with_lora(spec, lora: LoraArgs | None):
    if lora is None:
        return spec
    model_args = attrs.evolve(spec.config.model_args, lora=lora)
    return attrs.evolve(spec, config=attrs.evolve(spec.config, model_args=model_args))


LORA = LoraArgs(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
TRAINERS = [
    # (the in-process engine is megatron_tp2-inproc's in the default run)
    pytest.param("fsdp2_train", {}, "0", None, id="fsdp2-inproc", marks=pytest.mark.extended),
    pytest.param("fsdp2_train", {}, "1", None, id="fsdp2-mp"),
    pytest.param("fsdp2_train", {}, "0", LORA, id="fsdp2_lora-inproc", marks=pytest.mark.extended),
    pytest.param(
        "megatron_train",
        {"tensor_model_parallel_size": 2},
        "0",
        None,
        id="megatron_tp2-inproc",
        marks=pytest.mark.skipif(not _have_megatron(), reason="posttrain-megatron not installed"),
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainer_strategy, trainer_config, multiprocessing, lora", TRAINERS)
def test_sync_then_vllm_logprobs_match_trainer(
    trainer_strategy, trainer_config, multiprocessing, lora, tiny_model_path, tmp_path
):
    from posttrain.weight_sync.transport import SharedMemoryTransport

    before_procs, before_shm = descendants(), _shm_entries()
    launcher = LocalLauncher(call_timeout_s=180, start_timeout_s=180)
    try:
        spec = _spec(trainer_strategy, trainer_config, 2, "actor_train", tiny_model_path, tmp_path)
        trainer = launcher.start_group(_with_lora(spec, lora))
        batch = synthetic_train_batch(dp_size=trainer.dp_size)
        trainer.call_dp("train_step", batch.split(trainer.dp_size))
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
        started = time.monotonic()
        rollout = launcher.start_group(
            _spec("vllm", {}, 1, "actor_infer", tiny_model_path, tmp_path, env)
        )
        start_s = time.monotonic() - started
        started = time.monotonic()
        stats = SharedMemoryTransport(bucket_bytes=64 << 10).run(trainer, rollout)
        sync_s = time.monotonic() - started
        assert stats["buckets"] > 1
        sampling = SamplingParams(n=4, max_new_tokens=8)
        out = RolloutSamples.concat(
            rollout.call_dp(
                "generate", [GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3)]
            )
        )
        assert len(out) == 16
        sample_batch = samples_batch(out)
        shares = sample_batch.split(trainer.dp_size)
        from posttrain.protocol import concat_tensor_rows

        got = concat_tensor_rows(trainer.call_dp("compute_logprobs", shares))
        diff = max_sample_logprob_diff(out, got)
        print(
            f"\nvllm mp={multiprocessing}: engine start {start_s:.1f}s, sync {sync_s:.2f}s "
            f"({stats['buckets']} buckets), max |logprob diff| vs {trainer_strategy} = {diff:.2e}"
        )
        assert diff <= TOLERANCE
        if lora is not None:
            # The trained adapters reached vLLM: its log-probs are no longer the base model's.
            from posttrain.testing.expected import reference_logprobs

            base = reference_logprobs(tiny_model_path, None, sample_batch)
            assert max_sample_logprob_diff(out, base) > 10 * TOLERANCE
        # The engine's own scoring agrees too.
        scored = concat_tensor_rows(rollout.call_dp("compute_logprobs", [sample_batch]))
        assert float(((scored - got) * sample_batch.response_mask).abs().max()) <= TOLERANCE
        # CPU: no sleep mode, release/resume say so and carry on.
        assert rollout.call("release_memory", ["weights", "kv_cache"]) == [True]
        assert rollout.call("resume_memory", ["weights", "kv_cache"]) == [True]
    finally:
        launcher.shutdown()
    deadline = time.monotonic() + 20
    while engine_processes(before_procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine_processes(before_procs), "leaked processes"
    assert _shm_entries() == before_shm, "leaked tmpfs files"
    log = (tmp_path / "run" / "logs" / "actor_infer.rank0.log").read_text()
    assert log.count("vLLM has no sleep mode on CPU") == 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_data_parallel_engines(tiny_model_path, tmp_path):
    """Two ranks, TP 1: two independent engines, each answering its own share."""
    from posttrain.testing.expected import reference_logprobs

    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=120)
    try:
        group = launcher.start_group(_spec("vllm", {}, 2, "actor_infer", tiny_model_path, tmp_path))
        assert group.dp_size == 2
        assert [p["dp_rank"] for p in group.parallel] == [0, 1]
        sampling = SamplingParams(n=2, max_new_tokens=4)
        shares = [
            GenerationRequest(prompt_ids=PROMPTS[2 * i : 2 * i + 2], sampling=sampling, seed=i)
            for i in range(2)
        ]
        out = RolloutSamples.concat(group.call_dp("generate", shares))
        assert len(out) == 8
        assert out.prompt_ids[::2] == PROMPTS
        ref = reference_logprobs(tiny_model_path, None, samples_batch(out))
        assert max_sample_logprob_diff(out, ref) <= 1e-5
    finally:
        launcher.shutdown()


BESIDE = [
    pytest.param("fsdp2_train", {}, id="fsdp2", marks=pytest.mark.extended),
    pytest.param(
        "megatron_train",
        {"tensor_model_parallel_size": 2},
        id="megatron_tp2",
        marks=pytest.mark.skipif(not _have_megatron(), reason="posttrain-megatron not installed"),
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainer_strategy, trainer_config", BESIDE)
def test_in_process_sync_beside_the_trainer(
    trainer_strategy, trainer_config, tiny_model_path, tmp_path
):
    """Hybrid engine: vllm in the trainer's own 2 rank processes (vLLM's external launcher
    over the trainer's world, one engine per rank); after a step, the in-process hand-over (one
    call per rank, no host copy) gives both engines the trainer's weights: their sampled
    log-probs equal the trainer's."""
    from posttrain.protocol import concat_tensor_rows
    from posttrain.weight_sync.transport import InProcessTransport

    launcher = LocalLauncher(call_timeout_s=180, start_timeout_s=180)
    try:
        groups = launcher.start_processes(
            [
                _spec(
                    trainer_strategy, trainer_config, 2, "actor_train", tiny_model_path, tmp_path
                ),
                _spec("vllm", {}, 2, "actor_infer", tiny_model_path, tmp_path),
            ]
        )
        trainer, rollout = groups["actor_train"], groups["actor_infer"]
        assert trainer.shares_processes_with(rollout) and rollout.dp_size == 2
        batch = synthetic_train_batch(dp_size=trainer.dp_size)
        trainer.call_dp("train_step", batch.split(trainer.dp_size))
        calls = launcher.driver_calls()
        stats = InProcessTransport(bucket_bytes=64 << 10).run(trainer, rollout)
        assert launcher.driver_calls() - calls == 2  # one call per rank for the whole sync
        assert stats["buckets"] > 1
        sampling = SamplingParams(n=2, max_new_tokens=8)
        shares = [
            GenerationRequest(prompt_ids=PROMPTS[2 * i : 2 * i + 2], sampling=sampling, seed=i)
            for i in range(2)
        ]
        out = RolloutSamples.concat(rollout.call_dp("generate", shares))
        assert len(out) == 8
        sample_batch = samples_batch(out)
        shares = sample_batch.split(trainer.dp_size)
        got = concat_tensor_rows(trainer.call_dp("compute_logprobs", shares))
        diff = max_sample_logprob_diff(out, got)
        print(f"\nvllm beside {trainer_strategy}: max |logprob diff| = {diff:.2e}")
        assert diff <= TOLERANCE
    finally:
        launcher.shutdown()
