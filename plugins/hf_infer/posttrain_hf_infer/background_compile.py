"""``decode: auto`` on a GPU: the first generations decode with ``cuda_graph`` (graphs capture in
seconds) while the compiled step (:func:`~posttrain_hf_infer.static_decode.compiled_forward`,
2 minutes at 1.5B on an H200, cold) is built on a daemon thread; the generation that starts
after it is ready decodes ``compiled`` (never a switch inside a generation). ``decode:
compiled`` still compiles at its first generation, which waits.

The thread compiles the one function every compiled decoder shares (shape-generic,
``dynamic=True``) by running it on a small decoder of its own (its own cache and inputs, on the
model's weights) for two windows: one shorter than the cache, one the whole cache (Dynamo
specialises a slice that covers its whole tensor apart; with both traced, every later rows,
cache length and window ran the same code). On a GPU it then builds the compiled decode's fused
sampling kernel (``gumbel_draw``, Triton) too. Nothing it computes is read.

The thread and the generations share the device, the weights and Dynamo:

- A capture (the generating thread's) and the thread's runs of the compiled step never
  overlap (:data:`~posttrain_hf_infer.static_decode.DEVICE_WORK`): the first runs autotune
  Triton kernels, whose benchmarking synchronises the device. A capture does not wait for the
  lock: the step runs ungraphed and its window is captured at a later step. The compile's
  tracing and code generation (the minutes, on the host) run beside captures; captures use
  ``capture_error_mode="thread_local"``, under which another thread's CUDA calls do not fail
  them (the default, ``global``, forbids them process-wide). The runs use a stream of their
  own, synchronised before the lock is let go.
- A weight sync copies into the weights in place between generations: a run of the thread's
  step meanwhile reads half-synced weights, which is harmless (its output is discarded).
- An offload moves the weights, under a run's feet: :meth:`BackgroundCompile.stop` (the
  engine's ``release_memory`` calls it) waits for a run on the device, if one is in flight
  (seconds), and no run starts after it; a compile in progress runs on to its end on the host
  and is dropped (the next generation starts another, which finds the first's code in
  Dynamo's cache, or its kernels in torch's compile caches). Nothing waits for the compile
  itself: the thread is a daemon, and ``shutdown`` only stops it.
- Dynamo compiles under a process-wide lock: another function compiled meanwhile (on the
  generating thread) waits for this compile.
- The compile is Python, holding the GIL most of the time. A generating thread that lets the
  GIL go for a while (waiting for the device at a look at its rows) gets it back only after
  Python's switch interval (5 ms by default: measured on a CPU, a loop of 8 small ops and a
  0.5 ms wait took 0.66 ms alone, 5.8 ms beside a busy thread; 1.2 ms at 0.5 ms, 0.8 ms at
  0.1 ms): while the thread runs, the interval is :data:`SWITCH_INTERVAL`.
- The uncompiled paths switch the model's attention and stacked projections inside a block
  (Python state): the compiled step runs on a view of its own
  (:func:`~posttrain_hf_infer.static_decode.step_view`), which those switches never reach.
- SDPA's backends are process-wide flags: a step whose attention is cuDNN's by
  ``sdpa_kernel`` (``decode_attention: cudnn``, or ``auto`` where only cuDNN serves) switches
  them while Dynamo traces it, under a generation's SDPA calls. Such a step does not compile in
  the background (:func:`compiles_in_background`): ``auto`` compiles it first, as
  ``compiled``. The default on Hopper, the attention chosen by the rows, runs the Triton kernel
  in the thread (:func:`~posttrain_hf_infer.static_decode.decode_attention_by_rows`).

A compile that fails is logged once, as a warning: the generations go on with ``cuda_graph``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch

from posttrain_hf_infer import static_decode
from posttrain_hf_infer.static_decode import (
    CUDNN_ATTENTION,
    DEVICE_WORK,
    LENGTH_BUCKET,
    ROWS_BUCKET,
    StaticDecoder,
    step_attention,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain_hf_infer.fused_linears import LinearGroup
    from posttrain_hf_infer.static_decode import DecodeSettings

LOG = logging.getLogger(__name__)

# The thread's decoder: its rows, cache slots and first window all different (Dynamo makes
# sizes equal when traced one symbol: the code would serve only shapes where they are equal).
WARM_ROWS = ROWS_BUCKET
WARM_LENGTH = 2 * LENGTH_BUCKET


def _allocate_cache(decoder: StaticDecoder, model: PreTrainedModel, device: torch.device) -> None:
    """The warm decoder's cache tensors allocated now, as a generation's prefill allocates
    them: traced on a cache not yet allocated, the step's first compile would take the
    cache's first-call branch, which no generation's step takes (each runs after a prefill),
    and the generation that switched would compile again on its own thread (91 s at 1.5B on
    an H200)."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    decoder.cache.early_initialization(
        WARM_ROWS, text.num_key_value_heads, head_dim, model.dtype, device
    )


def compiles_in_background(model: PreTrainedModel, attention: str, device: torch.device) -> bool:
    """Whether the step of ``decode_attention: attention`` compiles in the background (see the
    module docstring: not where its attention switches SDPA's backends)."""
    return step_attention(attention, model, device) != CUDNN_ATTENTION


# Python's switch interval while a compile runs (see the module docstring), in seconds.
SWITCH_INTERVAL = 2e-4
_switching = threading.Lock()
_running = 0  # compiles running; the interval is put back when none is
_interval_before = 0.0


@contextlib.contextmanager
def short_switch_interval() -> Iterator[None]:
    """:data:`SWITCH_INTERVAL` inside the block (of any compile running), the interval before
    it once none is."""
    global _running, _interval_before
    with _switching:
        if _running == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_INTERVAL, _interval_before))
        _running += 1
    try:
        yield
    finally:
        with _switching:
            _running -= 1
            if _running == 0:
                sys.setswitchinterval(_interval_before)


class Stopped(Exception):
    """The compile was stopped (:meth:`BackgroundCompile.stop`) before its step ran."""


class BackgroundCompile:
    """The compiled step built on a daemon thread (see the module docstring), started at once.
    ``settings``: those of the compiled decoders to come (the thread's decoder runs them
    ungraphed); ``groups``: the model's stacked projections."""

    def __init__(
        self,
        model: PreTrainedModel,
        settings: DecodeSettings,
        groups: list[LinearGroup],
        device: torch.device | str,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # The thread's current device is its own: it sets this one (an index).
            device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.groups, self.device = model, groups, device
        self.settings = attrs.evolve(settings, graph=False, compiled=True)
        self.started = time.monotonic()
        self.seconds: float | None = None  # the compile's wall time, once it is ready
        self.error: BaseException | None = None
        self._stopped = False
        self._finished = threading.Event()
        threading.Thread(target=self._run, name="hf_infer-decode-compile", daemon=True).start()

    @property
    def ready(self) -> bool:
        """Whether the compiled step is built (and ran)."""
        return self.seconds is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to finish (ready, failed or stopped), at most ``timeout``
        seconds; whether it did."""
        return self._finished.wait(timeout)

    def stop(self, wait: bool = True) -> None:
        """No run of the step on the device after this. ``wait``: for the run in flight too
        (the weights are about to move); without, at once (the process is ending: a first run,
        which builds and tunes the kernels under the lock, took most of the compile's minutes
        on an H200, and a shutdown that waited for it held a short job's exit that long)."""
        if not wait:
            self._stopped = True  # (read under the lock before each run)
            return
        with DEVICE_WORK:
            self._stopped = True

    def on_device(self, compiled: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run the compiled step (on the thread): under the device lock, unless stopped, and
        finished on the device before the lock is let go."""
        with DEVICE_WORK:
            if self._stopped:
                raise Stopped
            out = compiled(*args)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            return out

    def _run(self) -> None:
        static_decode.background.job = self
        try:
            with torch.no_grad(), self._stream(), short_switch_interval():
                with DEVICE_WORK:  # its cache's allocations, out of any capture's way
                    if self._stopped:
                        return
                    decoder = StaticDecoder(
                        self.model, WARM_ROWS, WARM_LENGTH, self.device, self.settings, self.groups
                    )
                    _allocate_cache(decoder, self.model, self.device)
                for window in (WARM_LENGTH // 2, WARM_LENGTH):
                    logits = decoder.compiled_step(window)
                if self.device.type == "cuda":
                    self._warm_sampling(logits)
            self.seconds = time.monotonic() - self.started
        except Stopped:
            LOG.debug("hf_infer: the background compile of the decode step was stopped")
        except Exception as error:  # a failure anywhere in torch.compile: the run goes on
            if self._stopped:  # the weights moved under the tracing: the engine dropped it
                LOG.debug("hf_infer: a stopped background compile failed: %s", error)
                return
            self.error = error
            LOG.warning(
                "hf_infer: the decode step did not compile in the background (%s: %s): "
                "generations go on decoding with cuda_graph",
                type(error).__name__,
                error,
            )
        finally:
            static_decode.background.job = None
            self._finished.set()

    def _warm_sampling(self, logits: torch.Tensor) -> None:
        """The compiled decode's fused sampling on a GPU (``gumbel_draw``: a Triton kernel, built
        at its first call), built here rather than in the generation that switches."""
        from posttrain_hf_infer.token_sampling import gumbel_draw

        with DEVICE_WORK:
            if self._stopped:
                raise Stopped
            gumbel_draw(logits, 1.0, torch.Generator(self.device))
            torch.cuda.current_stream().synchronize()

    def _stream(self) -> Any:
        """The thread's device and a stream of its own (its runs queue beside the
        generation's, not behind them), or nothing on the CPU."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(self.device)
        return torch.cuda.stream(torch.cuda.Stream(self.device))
