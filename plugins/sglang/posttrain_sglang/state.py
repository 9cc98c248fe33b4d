"""What a rank of the ``sglang`` strategy keeps between calls (``worker.engine_state``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine
    from transformers import PreTrainedTokenizerBase

    from posttrain import WorkerContext


@attrs.define(kw_only=True)
class SGLangState:
    tokenizer: PreTrainedTokenizerBase | None = None  # set by load_model, on every rank
    # The replica's engine; None on the other ranks of a replica and after shutdown.
    engine: Engine | None = None
    # The engine-kind files in /dev/shm before the engine started (see leftovers).
    shm_before: set[str] | None = None
    # Why the engine is unusable (a call timed out: see calls); None while it is usable.
    broken: str | None = None
    no_release_warned: bool = False


def rank_state(worker: WorkerContext) -> SGLangState:
    return worker.engine_state(SGLangState)


def tokenizer(worker: WorkerContext) -> PreTrainedTokenizerBase:
    loaded = rank_state(worker).tokenizer
    if loaded is None:
        raise RuntimeError("sglang: the tokenizer is loaded with the model (load_model)")
    return loaded
