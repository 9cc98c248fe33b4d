"""hf_infer's ``decode: auto`` on a GPU (background_compile): generations decode uncompiled while
the compiled step is built on a thread, then compiled. On the CPU, with the CPU let in
(``BACKGROUND_COMPILE_DEVICES``): the static step (the graphed one's code) while a real
``torch.compile`` (Dynamo, with the ``eager`` backend in place of Inductor) runs on the thread."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import attrs
import pytest
import torch

from posttrain.protocol import GenerationRequest, SamplingParams
from posttrain.testing.batches import PROMPTS

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]


@pytest.fixture
def device() -> str:
    """The engine's device (a test may parametrize it)."""
    return "cpu"


@pytest.fixture
def auto_on_cpu(request, device, monkeypatch):
    """The session's engine (on ``device``) with ``decode: auto`` compiling in the background
    (on the CPU too), a compiled function of its own (an eager backend: its own entries in
    Dynamo's cache), the main thread's compiled steps and the compiles' threads recorded; the
    job dropped at the end."""
    from posttrain_hf_infer import engine, static_decode
    from posttrain_hf_infer.engine import HFInferState

    settings = request.getfixturevalue(
        "hf_infer_settings" if device == "cpu" else "hf_infer_cuda_settings"
    )
    monkeypatch.setattr(engine, "BACKGROUND_COMPILE_DEVICES", ("cpu",))
    compiles: list[str] = []  # the thread of each compile

    def eager(graph, example_inputs):
        compiles.append(threading.current_thread().name)
        return graph.forward

    monkeypatch.setattr(static_decode, "STEP_BACKEND", eager)
    monkeypatch.setattr(static_decode, "_compiled_forward", None)
    main_steps: list[int] = []
    compiled_step = static_decode.StaticDecoder.compiled_step

    def counted(self, window):
        if threading.current_thread() is threading.main_thread():
            main_steps.append(window)
        return compiled_step(self, window)

    monkeypatch.setattr(static_decode.StaticDecoder, "compiled_step", counted)
    with settings(decode="auto") as worker:
        state = worker.engine_state(HFInferState)
        try:
            yield worker, state, main_steps, compiles
        finally:
            if state.compile_job is not None:
                state.compile_job.stop()
                state.compile_job.wait(30)
            state.compile_job = None


def generate(worker, sampling, seed=3):
    from posttrain_hf_infer import engine

    request = GenerationRequest(prompt_ids=PROMPTS[:3], sampling=sampling, seed=seed)
    return engine.generate(worker, request)


# Sampled (top-k: the general sampling in every mode, so the same seed draws alike).
SAMPLING = SamplingParams(n=2, max_new_tokens=9, temperature=1.0, top_k=20)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_auto_decodes_uncompiled_then_compiled_once_the_compile_is_done(auto_on_cpu, device):
    """On a GPU: the first generation's graphs captured while the thread compiles."""
    worker, state, main_steps, compiles = auto_on_cpu
    interval = sys.getswitchinterval()
    # Longer than a window: its steps attend to part of the cache, then to all of it.
    sampling = attrs.evolve(SAMPLING, max_new_tokens=150, ignore_eos=True)
    first = generate(worker, sampling)
    assert state.decode_served == ("static" if device == "cpu" else "cuda_graph")
    assert main_steps == []
    job = state.compile_job
    assert job is not None and job.wait(60)
    assert job.ready and job.error is None and job.seconds > 0
    assert sys.getswitchinterval() == interval  # put back
    second = generate(worker, sampling)
    assert state.decode_served == "compiled"
    assert main_steps  # the steps ran the compiled function, on the generating thread
    # ... compiled by the thread alone: its two windows (shorter than the cache, and all of
    # it) cover the generation's decoders.
    assert compiles and set(compiles) == {"hf_infer-decode-compile"}
    assert second.response_ids == first.response_ids
    for x, y in zip(second.response_logprobs, first.response_logprobs):
        assert x == pytest.approx(y, abs=1e-5)


def test_a_compile_that_fails_leaves_the_engine_decoding(auto_on_cpu, monkeypatch, caplog):
    from posttrain_hf_infer import static_decode

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(static_decode, "compiled_forward", lambda: broken)
    worker, state, _, _ = auto_on_cpu
    with caplog.at_level(logging.WARNING):
        first = generate(worker, SAMPLING)
        assert state.compile_job is not None and state.compile_job.wait(30)
        second = generate(worker, SAMPLING)
    assert state.compile_job.error is not None and not state.compile_job.ready
    assert state.decode_served == "static"
    assert second == first
    warnings = [r for r in caplog.records if "did not compile in the background" in r.message]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].message


def test_an_offload_stops_the_compile_before_it_runs_anything(auto_on_cpu, monkeypatch):
    """An offload while compiling stops the thread: it runs nothing on the device."""
    from posttrain_hf_infer import background_compile, engine, static_decode

    worker, state, _, _ = auto_on_cpu
    hold = threading.Event()
    step = static_decode.StaticDecoder.compiled_step

    def held(self, window):
        if threading.current_thread() is not threading.main_thread():
            hold.wait(30)
        return step(self, window)

    monkeypatch.setattr(static_decode.StaticDecoder, "compiled_step", held)
    ran: list[str] = []
    monkeypatch.setattr(
        background_compile.BackgroundCompile, "on_device", _record(ran, background_compile)
    )
    generate(worker, SAMPLING)
    job = state.compile_job
    worker.config = attrs.evolve(worker.config, param_offload=True)
    engine.release_memory(worker, ["weights"])  # on the CPU the weights stay where they are
    engine.resume_memory(worker, ["weights"])
    assert state.compile_job is None  # the next generation starts another
    hold.set()
    assert job.wait(30) and not job.ready and job.error is None
    assert ran == ["stopped"]


def _record(ran: list[str], module):
    on_device = module.BackgroundCompile.on_device

    def record(self, compiled, args):
        with contextlib.suppress(module.Stopped):
            return on_device(self, compiled, args)
        ran.append("stopped")
        raise module.Stopped

    return record


def test_the_step_view_shares_the_weights_not_the_switches(hf_infer_settings):
    """The compiled step's view: the model's parameters, its own attention and projections."""
    from posttrain_hf_infer import static_decode
    from posttrain_hf_infer.fused_linears import fuse_sibling_linears, stacked_projections

    with hf_infer_settings() as worker:
        model = worker.model
        groups = fuse_sibling_linears(model)
        view = static_decode.step_view(model, static_decode.ATTENTION, groups)
        assert view is not model and view.config is not model.config
        assert view.config._attn_implementation == static_decode.ATTENTION
        assert model.config._attn_implementation != static_decode.ATTENTION
        ours = dict(model.named_parameters())
        assert all(p is ours[name] for name, p in view.named_parameters())
        assert all(not g.active for g in groups)
        hook = model.model.layers[0].register_forward_hook(lambda *args: None)
        assert not view.model.layers[0]._forward_hooks  # a hook added later stays the model's
        hook.remove()
        ids = torch.tensor([PROMPTS[0]])
        with torch.no_grad():
            ran = view(input_ids=ids).logits
            attention = static_decode.attention_of(model, static_decode.ATTENTION)
            with attention, stacked_projections(groups):
                switched = model(input_ids=ids).logits
        assert torch.equal(ran, switched)


def test_a_shutdown_does_not_wait_for_a_compile_on_the_device(auto_on_cpu):
    """The process is ending: the shutdown stops the compile without waiting for a run of the
    step in flight (on a GPU its first run builds the kernels: minutes)."""
    from posttrain_hf_infer import engine
    from posttrain_hf_infer.static_decode import DEVICE_WORK

    worker, state, _, _ = auto_on_cpu
    generate(worker, SAMPLING)
    job = state.compile_job
    held, release = threading.Event(), threading.Event()

    def in_flight():  # a run of the step on the device, as the thread's first one
        with DEVICE_WORK:
            held.set()
            release.wait(30)

    runner = threading.Thread(target=in_flight)
    runner.start()
    try:
        assert held.wait(10)
        done = threading.Event()
        threading.Thread(target=lambda: (engine.shutdown_worker(worker), done.set())).start()
        assert done.wait(5), "the shutdown waited for the device run"
        assert job._stopped
    finally:
        release.set()
        runner.join()
