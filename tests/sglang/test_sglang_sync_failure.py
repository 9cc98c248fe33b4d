"""A trainer that dies, or stalls, in the middle of a broadcast weight update: the SGLang side
gives up with a clear error within the transport's timeout instead of hanging.

SGLang makes its weight-update group with torch's default 30-minute timeout and its Engine calls
wait without a limit; the plugin bounds every call of the update (see posttrain_sglang.calls).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from posttrain.errors import WorkerError
from posttrain.launch.local import LocalLauncher
from posttrain.protocol import GenerationRequest, RolloutSamples, SamplingParams
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import max_sample_logprob_diff, reference_logprobs, samples_batch
from posttrain.testing.groups import descendants, engine_processes, group_spec
from posttrain.weight_sync.transport import RANK_SIDE, BroadcastTransport

pytest.importorskip("posttrain_fsdp")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT_S = 10.0
BUCKET_BYTES = 64 << 10


def _start_update(launcher, rollout, model_path, run_dir):
    """A fresh one-rank trainer, a sync group with the engine, and the engine waiting inside the
    first bucket's broadcast. Returns the trainer and the rollout's pending receive."""
    trainer = launcher.start_group(
        group_spec("fsdp2_train", {}, 1, "actor_train", model_path, run_dir)
    )
    transport = BroadcastTransport(bucket_bytes=BUCKET_BYTES)
    transport.timeout_s = TIMEOUT_S
    transport._join(trainer, rollout)
    trainer.call("export_begin", BUCKET_BYTES)
    meta = trainer.call("run_function", f"{RANK_SIDE}:export_next_meta")[0]
    assert meta, "the first bucket holds tensors"
    pending = rollout.submit("run_function", args=(f"{RANK_SIDE}:receive_and_import", meta))
    time.sleep(2.0)  # the scheduler has joined the broadcast and waits for the bytes
    return trainer, pending


def _generate(rollout):
    sampling = SamplingParams(n=2, max_new_tokens=4)
    request = GenerationRequest(prompt_ids=PROMPTS, sampling=sampling, seed=1)
    return RolloutSamples.concat(rollout.call_dp("generate", [request]))


def test_trainer_killed_or_stalled_mid_update(tiny_model_path, tmp_path):
    before = descendants()
    launcher = LocalLauncher(call_timeout_s=120, start_timeout_s=240)
    try:
        rollout = launcher.start_group(
            group_spec("sglang", {}, 1, "actor_infer", tiny_model_path, tmp_path)
        )

        # 1. The trainer process dies inside the broadcast: the collective fails at once (the
        #    peer's sockets close), SGLang reports it, the plugin closes the update session.
        trainer, pending = _start_update(launcher, rollout, tiny_model_path, tmp_path)
        trainer.procs[0].kill()
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            pending.wait()
        killed_s = time.monotonic() - started
        message = str(err.value)
        print(f"\ntrainer killed: the SGLang side failed after {killed_s:.1f}s: {message[:300]}")
        assert killed_s < TIMEOUT_S + 5
        assert err.value.role == "actor_infer"
        assert "sglang:" in message and "update_weights_from_distributed" in message
        # The failed update loaded nothing: the engine still serves the checkpoint's weights.
        out = _generate(rollout)
        ref = reference_logprobs(tiny_model_path, None, samples_batch(out))
        assert max_sample_logprob_diff(out, ref) <= 1e-5

        # 2. The trainer process stalls (SIGSTOP: its sockets stay open, as with a hung peer or
        #    NCCL): only the plugin's timeout ends the wait.
        trainer, pending = _start_update(launcher, rollout, tiny_model_path, tmp_path)
        pid = trainer.procs[0].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerError) as err:
                pending.wait()
            stalled_s = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGKILL)
        message = str(err.value)
        print(f"trainer stalled: the SGLang side gave up after {stalled_s:.1f}s: {message[:300]}")
        assert TIMEOUT_S - 3 <= stalled_s < TIMEOUT_S + 10
        assert f"did not finish within {TIMEOUT_S:.0f}s" in message
        assert "trainer side of the weight sync" in message
        # The engine may still sit in the collective: later calls fail at once, saying why.
        with pytest.raises(WorkerError, match="unusable since an earlier failure"):
            _generate(rollout)
    finally:
        launcher.shutdown()
    deadline = time.monotonic() + 30
    while engine_processes(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine_processes(before), "the stuck engine's processes must still be stopped"
