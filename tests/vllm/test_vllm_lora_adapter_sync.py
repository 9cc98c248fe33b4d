"""fsdp2_train training LoRA adapters -> adapter-only weight sync -> vllm, which keeps its base
weights and applies the synced adapters (vLLM's LoRA): rollout log-probs equal the trainer's.

In-process engine, and (extended) vLLM's multiprocessing engine. Two train-and-sync rounds on
one engine, so the second sync replaces the first's adapter (a new ``LoRARequest``; the old one
and its tmpfs directory are removed). Each sync carries the adapters' bytes alone.
"""

from __future__ import annotations

import os
import time

import pytest
from safetensors.torch import load_file
from test_vllm_sync_parity import TOLERANCE, _shm_entries, _spec, _with_lora

from posttrain.config.sections import LoraArgs
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import GenerationRequest, RolloutSamples, SamplingParams, concat_tensor_rows
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import (
    max_sample_logprob_diff,
    reference_logprobs,
    samples_batch,
    synthetic_train_batch,
)
from posttrain.testing.groups import descendants, engine_processes

pytest.importorskip("posttrain_fsdp")

LORA = LoraArgs(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"], sync="adapter")


def _adapter_bytes(model_path: str, lora: LoraArgs) -> int:
    """fp32 bytes of every targeted module's lora_A (rank x in) and lora_B (out x rank)."""
    base = load_file(os.path.join(model_path, "model.safetensors"))
    return sum(
        lora.rank * (t.shape[0] + t.shape[1]) * 4
        for name, t in base.items()
        if name.endswith(".weight") and name.split(".")[-2] in lora.target_modules
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "multiprocessing",
    [
        pytest.param("0", id="inproc"),
        # vLLM's engine process reads the adapter directory itself.
        pytest.param("1", id="mp", marks=pytest.mark.extended),
    ],
)
def test_adapter_sync_then_vllm_logprobs_match_trainer(multiprocessing, tiny_model_path, tmp_path):
    from posttrain.weight_sync.transport import SharedMemoryTransport

    before_procs, before_shm = descendants(), _shm_entries()
    launcher = LocalLauncher(call_timeout_s=180, start_timeout_s=180)
    try:
        spec = _spec("fsdp2_train", {}, 2, "actor_train", tiny_model_path, tmp_path)
        trainer = launcher.start_group(_with_lora(spec, LORA))
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
        spec = _spec("vllm", {}, 1, "actor_infer", tiny_model_path, tmp_path, env)
        rollout = launcher.start_group(_with_lora(spec, LORA))
        sampling = SamplingParams(n=4, max_new_tokens=8)
        for step in range(2):
            batch = synthetic_train_batch(seed=step, dp_size=trainer.dp_size)
            trainer.call_dp("train_step", batch.split(trainer.dp_size))
            started = time.monotonic()
            stats = SharedMemoryTransport(bucket_bytes=64 << 10).run(trainer, rollout)
            sync_s = time.monotonic() - started
            assert stats["bytes"] == _adapter_bytes(tiny_model_path, LORA)
            # One adapter directory on tmpfs: the previous sync's is gone.
            assert len(_shm_entries() - before_shm) == 1
            request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=3 + step)
            out = RolloutSamples.concat(rollout.call_dp("generate", [request]))
            sample_batch = samples_batch(out)
            got = concat_tensor_rows(
                trainer.call_dp("compute_logprobs", sample_batch.split(trainer.dp_size))
            )
            diff = max_sample_logprob_diff(out, got)
            print(
                f"\nvllm adapter sync {step}: {stats['bytes']} bytes in {sync_s:.2f}s, "
                f"max |logprob diff| vs fsdp2_train = {diff:.2e}"
            )
            assert diff <= TOLERANCE
            # The adapters reached vLLM: its log-probs are no longer the base model's.
            base = reference_logprobs(tiny_model_path, None, sample_batch)
            assert max_sample_logprob_diff(out, base) > 10 * TOLERANCE
        # The engine's own scoring applies the adapter too.
        scored = concat_tensor_rows(rollout.call_dp("compute_logprobs", [sample_batch]))
        assert float(((scored - got) * sample_batch.response_mask).abs().max()) <= TOLERANCE
    finally:
        launcher.shutdown()
    deadline = time.monotonic() + 20
    while engine_processes(before_procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine_processes(before_procs), "leaked processes"
    assert _shm_entries() == before_shm, "leaked tmpfs files"
