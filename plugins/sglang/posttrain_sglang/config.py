"""``strategy_config`` of ``sglang`` (its own module: the engine's argument checks read its
fields without importing the plugin module)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain import at_least, between

DtypeName = Literal["auto", "fp32", "bf16", "fp16"]


@attrs.frozen(kw_only=True)
class SGLangConfig:
    """``strategy_config`` of ``sglang``; every field maps to one of SGLang's ``ServerArgs``.

    ``None`` means SGLang's own default, except where noted. Anything else SGLang accepts goes in
    ``engine_kwargs``; it is checked against SGLang's ``ServerArgs`` when the engine starts.
    The engine is SGLang's in-process ``Engine``: its scheduler runs in child processes of the
    rank that drives it.
    """

    # GPUs per engine (SGLang tensor parallelism); data-parallel replicas = ranks / this.
    tp_size: int = attrs.field(default=1, validator=at_least(1))
    # Share of each GPU's memory for weights + KV cache. GPU only.
    mem_fraction_static: float | None = attrs.field(
        default=None, validator=between(0, 1, low_open=True, high_open=True)
    )
    # KV-cache size in tokens; None: 4096 on CPU (uncapped SGLang takes ~15 GB there), and
    # mem_fraction_static on GPU.
    max_total_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    # None: "torch_native" on CPU, SGLang's choice on GPU.
    attention_backend: str | None = None
    # Weight dtype in the engine; None: the role's model_args.dtype.
    dtype: DtypeName | None = None
    # Longest prompt + response; None: the model's max_position_embeddings.
    context_length: int | None = attrs.field(default=None, validator=at_least(1))
    # Engine seed; None: the run's seed. (Requests carry a sampling seed too, which SGLang
    # honours only with engine_kwargs {enable_deterministic_inference: true}.)
    random_seed: int | None = None
    # "cpu" or "cuda"; None: the role's device.
    device: Literal["cpu", "cuda"] | None = None
    # Release/resume memory for colocated roles (torch_memory_saver); None: on with GPUs, off on
    # CPU (SGLang does not release memory there).
    enable_memory_saver: bool | None = None
    # Any other SGLang ServerArgs field, passed through unchanged.
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict)
