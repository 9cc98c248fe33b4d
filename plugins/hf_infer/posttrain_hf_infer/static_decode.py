"""``hf_infer``'s fixed-shape decode: a transformers ``StaticCache`` and a one-token step whose
tensors keep their addresses, so that on a GPU the step is captured in a CUDA graph once and then
replayed (one launch for the whole forward pass instead of one per kernel: at 1.5B, a dynamic-
cache step is bound by those launches, not by the GPU).

A :class:`StaticDecoder` serves one (rows, cache length) shape; the engine keeps a few, keyed by
shape buckets (rows rounded up to a multiple of 8, lengths to 128) so that the batches of later
steps reuse them. Weight syncs copy into the parameters in place: the captured graph reads the
new weights. Moving the weights (offload) invalidates it: the engine then drops its decoders.

The attention mask is built here, in the cache's coordinates (a prompt left-padded to ``width``,
the width of the prompts it was prefilled with, occupies ``0 .. width - 1`` of its row, the i-th
new token ``width + i``): a key is visible to a query when it is the prompt's (not padding) or a
new token, and not after the query. Every query also sees
itself, so a padding row never attends to nothing (which would put NaN into the cache).

Each row writes its next token at a slot of its own (:func:`row_slot_layer`): a row that
ended stops there, and an ended row is refilled with another prompt (prefilled on its own, its
keys and values copied into the row's slots) while the other rows go on decoding (continuous
batching: :mod:`~posttrain_hf_infer.decode_loop` decides when).

A step attends to the cache's first slots only, up to the latest row's query rounded up to
``WINDOW_BUCKET``: reading the whole cache at every step (a 512-token generation fills half of
it on average) was a quarter of a graphed 1.5B step at 256 rows on an H200. Each window is a
shape of its own, so the graphed step keeps one graph per window (captured the first time a
generation reaches it); they share the cache, and only the mask says which slots they read.

``compiled`` runs the one-token step (the mask, the model's forward) through ``torch.compile``
before it is captured: the normalisations, rotary embeddings, activations and the mask each
become one fused kernel instead of several (at 1.5B and 256 rows on an H200 those unfused
element-wise kernels were a fifth of the graphed step). It is compiled once, shape-generic
(``dynamic=True``), at the first generation (``decode: compiled``) or on a background thread
while the first generations run graphed (``decode: auto``,
:mod:`~posttrain_hf_infer.background_compile`): 2 minutes at 1.5B on an H200, against 74 s for
a compile of one shape that every new window, batch or cache length then compiled again (another
88 s each); the steps run as fast either way (61k decode tokens/s at 256 rows). A later process
finds most of it in torch's compile caches (49 s instead of 124). Compiling one decoder layer
for all (``torch.compiler.nested_compile_region``) took 56 s, but the cache write inside the
region made the rows static (torch 2.11-2.13): each rows bucket compiled again. The prefill, a
new shape at every generation, stays eager.

The compiled step runs on a view of the model (:func:`step_view`): its own module objects over
the same parameters, its own config (the step's attention set once) and its own stacked
projections, always active. The uncompiled paths switch the model's attention and projections
inside a block (:func:`attention_of`, ``stacked_projections``): shared Python state that a
compile on another thread (:mod:`~posttrain_hf_infer.background_compile`, what ``decode: auto``
does on a GPU) would read half switched, and trace into its graph. Dynamo does not guard on the
module objects: a view built later (after an offload) runs the same compiled code.

A mixture-of-experts model's forward passes here (prefill and steps, compiled or not) all run
on such a view, whose experts run grouped GEMMs and whose routers write each token's experts
into the decoder's routing slots (:mod:`~posttrain_hf_infer.moe_decode`): the routing that
routing replay asks of the rollout, recorded inside the captured step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import inspect
import logging
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from posttrain_hf_infer import moe_decode
from posttrain_hf_infer.fused_linears import LinearGroup, stacked_projections
from posttrain_hf_infer.moe_decode import RoutingSlots, is_moe

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel
    from transformers.cache_utils import StaticLayer

LOG = logging.getLogger(__name__)

ROWS_BUCKET = 8
LENGTH_BUCKET = 128
WINDOW_BUCKET = 128  # slots attended: the query's slot + 1, rounded up to a multiple of this
KEPT_SHAPES = 4  # decoders (caches, graphs) kept at once; the oldest goes first


# The attentions the static path runs (registered with transformers' AttentionInterface):
# grouped SDPA everywhere, or for the one-token steps a kernel that reads each KV head once for
# the query heads sharing it, where it serves: one of them, or either by the rows
# (step_attention).
ATTENTION = "posttrain_grouped_sdpa"
CUDNN_ATTENTION = "posttrain_cudnn_sdpa"
TRITON_ATTENTION = "posttrain_triton_decode"
BY_ROWS_ATTENTION = "posttrain_decode_by_rows"


def in_window(
    key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the cache's first slots, as many as the mask covers (the step's
    window: the keys past it are not read)."""
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
        window = attention_mask.shape[-1]
        key, value = key[:, :, :window], value[:, :, :window]
    return key, value


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with the query heads sharing a KV head folded into one group of queries, instead of
    the KV heads repeated per query head (transformers' sdpa does that whenever a mask is given:
    at 256 rows and 640 cache slots those copies took 45% of a graphed 1.5B decode step on an
    H200). ``query``: [batch, heads, q, dim]; ``key``/``value``: [batch, kv_heads, slots, dim];
    the mask: [batch, 1, q, slots], its slots the cache's first ones (:func:`in_window`).
    Returns [batch, q, heads, dim], as transformers' functions."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    key, value = in_window(key, value, attention_mask)
    groups = heads // kv_heads
    query = query.reshape(batch, kv_heads, groups * length, dim)  # head = kv_head * groups + g
    mask = attention_mask
    if mask is not None and groups > 1:
        slots = mask.shape[-1]
        mask = mask[:, :, None].expand(batch, mask.shape[1], groups, length, slots)
        mask = mask.reshape(batch, -1, groups * length, slots)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def cudnn_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """A one-token step's attention in cuDNN's fused kernel, which reads each KV head once for
    the query heads sharing it (``enable_gqa``) and broadcasts the mask over the heads: at 256
    rows on an H200 it read the cache at 2.2 / 3.3 / 3.7 TB/s (15 / 31 / 46 us a layer at
    128 / 384 / 640-slot windows), grouped SDPA's kernel at 1.6 / 1.9 / 2.0 TB/s (21 / 54 / 84
    us). SDPA's other kernels would repeat the KV heads for it: only where
    :func:`cudnn_serves`. Longer inputs (the prefill) take :func:`grouped_sdpa`."""
    if query.shape[2] != 1:
        return grouped_sdpa(module, query, key, value, attention_mask, scaling)
    return cudnn_one_token(query, key, value, attention_mask, scaling), None


def cudnn_one_token(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """:func:`cudnn_sdpa` of one-token queries: ``[rows, 1, heads, dim]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key, value = in_window(key, value, mask)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous()


def triton_decode(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """A one-token step's attention in the Triton kernel of
    :mod:`~posttrain_hf_infer.decode_attention_kernel` (registered as the operator
    ``posttrain::decode_attention``: the compiler calls it as it is): each KV head read once for its
    query heads, and no slot after a row's last visible one. Only where :func:`triton_serves`.
    Longer inputs (the prefill) take :func:`grouped_sdpa`."""
    if query.shape[2] != 1:
        return grouped_sdpa(module, query, key, value, attention_mask, scaling)
    from posttrain_hf_infer.decode_attention_kernel import decode_attention_op

    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return decode_attention_op(query, key, value, attention_mask, scale), None


def decode_by_rows(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """A one-token step's attention in the Triton kernel or cuDNN's, whichever reads faster for
    its rows (:func:`triton_prefers`), chosen when the step runs: the operator
    ``posttrain::decode_attention_by_rows``. Where both serve. Longer inputs (the prefill) take
    :func:`grouped_sdpa`."""
    if query.shape[2] != 1:
        return grouped_sdpa(module, query, key, value, attention_mask, scaling)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return decode_attention_by_rows(query, key, value, attention_mask, scale), None


@torch.library.custom_op("posttrain::decode_attention_by_rows", mutates_args=())
def decode_attention_by_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`decode_by_rows`'s choice as an operator, made at each call (a graphed step's: at
    its capture), not in the compiled step: a choice made there is one of the compiled graph's
    guards, and a decoder with the other kernel (a later request with fewer rows) compiled the
    step again (2 minutes at 1.5B on an H200). A background compile's runs take the Triton
    kernel: cuDNN's is chosen by switching SDPA's backends, process-wide flags that the
    generating thread's SDPA calls read meanwhile (their output is not read: either serves)."""
    on_background = getattr(background, "job", None) is not None
    if on_background or triton_prefers(query.shape[0], key.shape[1], query.device):
        from posttrain_hf_infer.decode_attention_kernel import decode_attention

        return decode_attention(query, key, value, mask, scale)
    return cudnn_one_token(query, key, value, mask, scale)


@decode_attention_by_rows.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    rows, heads, _, dim = query.shape
    return query.new_empty(rows, 1, heads, dim)


def _model_shape(model: PreTrainedModel) -> tuple[int, int, int, torch.dtype]:
    """The decoder's query heads, KV heads, head size and dtype."""
    config = model.config.get_text_config(decoder=True)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, dim, model.get_input_embeddings().weight.dtype


def cudnn_serves(model: PreTrainedModel, device: torch.device | str) -> bool:
    """Whether cuDNN's attention runs a decoder's one-token steps: this torch's cuDNN on this
    GPU, for the model's heads and dtype, over windows of ``WINDOW_BUCKET`` slots (every window
    is a multiple of it)."""
    if torch.device(device).type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

    heads, kv_heads, dim, dtype = _model_shape(model)
    like = {"dtype": dtype, "device": device}
    rows = ROWS_BUCKET
    query = torch.empty(rows, heads, 1, dim, **like)
    key = torch.empty(rows, kv_heads, WINDOW_BUCKET, dim, **like)
    mask = torch.empty(rows, 1, 1, WINDOW_BUCKET, **like)
    return can_use_cudnn_attention(SDPAParams(query, key, key, mask, 0.0, False, True))


def triton_serves(model: PreTrainedModel, device: torch.device | str) -> bool:
    """Whether the Triton kernel runs a decoder's one-token steps: Triton installed, a GPU of
    compute capability 8.0 or later (bf16 on tensor cores), a bf16 or fp16 model (fp32 would
    round through TF32 in the kernel's products) with a head size that is a power of two from
    16 to 256."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    heads, kv_heads, dim, dtype = _model_shape(model)
    return (
        torch.cuda.get_device_capability(device) >= (8, 0)
        and dtype in (torch.bfloat16, torch.float16)
        and heads % kv_heads == 0
        and 16 <= dim <= 256
        and dim & (dim - 1) == 0
    )


# Rows x KV heads per streaming multiprocessor from which the Triton kernel reads the cache
# faster than cuDNN's (one program per row and KV head: with fewer it is bound by latency).
# Both kernels' times follow rows x KV heads. On an H200 (132 SMs; head size 128, the windows
# of 128, 384 and 640 slots summed; benchmarks/decode_attention.py), with 2, 4 and 8 KV heads:
# 128 programs, cuDNN's 25 us against 32-33; 192, a tie (40 against 40-41); 256, Triton's
# 43 against 46; 384 and more, Triton's by 14-25%.
TRITON_PROGRAMS_PER_SM = 1.5


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_prefers(rows: int, kv_heads: int, device: torch.device | str) -> bool:
    """Whether the Triton kernel is the faster of the two for ``rows`` (by its programs per
    streaming multiprocessor, :data:`TRITON_PROGRAMS_PER_SM`)."""
    return rows * kv_heads >= TRITON_PROGRAMS_PER_SM * _multiprocessors(torch.device(device))


def step_attention(choice: str, model: PreTrainedModel, device: torch.device | str) -> str:
    """The attention of a decoder's one-token steps for ``strategy_config.decode_attention``
    (``choice``): "triton" or "cudnn" that kernel where it serves; "auto" either by the rows
    (:func:`decode_by_rows`) where both serve, else the one that does; grouped SDPA
    otherwise, and for "sdpa"."""
    serves = {"triton": triton_serves(model, device), "cudnn": cudnn_serves(model, device)}
    if choice == "auto":
        if all(serves.values()):
            return BY_ROWS_ATTENTION
        choice = next((kernel for kernel, ok in serves.items() if ok), "sdpa")
    if not serves.get(choice):
        return ATTENTION
    return TRITON_ATTENTION if choice == "triton" else CUDNN_ATTENTION


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, grouped_sdpa)
    AttentionInterface.register(CUDNN_ATTENTION, cudnn_sdpa)
    AttentionInterface.register(TRITON_ATTENTION, triton_decode)
    AttentionInterface.register(BY_ROWS_ATTENTION, decode_by_rows)


@contextlib.contextmanager
def attention_of(model: PreTrainedModel, name: str) -> Iterator[None]:
    """The model's layers call attention ``name`` inside the block (the rest of the engine, the
    scoring forward passes with their 2D masks, keeps the model's own)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def cache_argument(model: PreTrainedModel) -> str:
    """The forward argument taking the KV cache: ``cache`` in newer transformers, else
    ``past_key_values`` (the old name is deprecated where the new one exists)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def supports_static(model: PreTrainedModel) -> bool:
    """Whether every attention layer is full attention: the mask built here is one for all
    layers, so sliding-window (or other) layers keep the dynamic path."""
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


def prompt_positions(attention: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts: each row counts from 0 at its first real token
    (padding at 0 too: it is masked)."""
    return (attention.cumsum(-1) - 1).clamp(min=0)


def decode_forward(
    model: PreTrainedModel,
    cache: dict[str, Cache],
    visible: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """The logits ``[rows, vocab]`` after the tokens ``ids`` at cache slots ``queries``
    (``[1, q]``, the same for every row, or ``[rows, q]``): the mask of those queries over the
    cache's first ``window`` slots (a key is visible when ``visible`` and not after the query;
    each query sees itself), then the model's forward."""
    keys = slots[None, None, :window]
    at = queries[:, :, None]
    seen = (visible[:, None, :window] & (keys <= at)) | (keys == at)
    dtype = model.get_input_embeddings().weight.dtype
    mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache,
    )
    return out.logits[:, -1]


# decode_forward, or it compiled.
StepForward = Callable[..., torch.Tensor]
_compiled_forward: StepForward | None = None

# The compiler backend behind the compiled step (the CPU tests take "eager": Dynamo's tracing,
# guards and threads as on a GPU, without Inductor's minutes).
STEP_BACKEND = "inductor"

# Held while a graph is captured (by the thread deciding, :meth:`StaticDecoder._capture`) and
# while a background compile's step runs on the device (:func:`gated_backend`), so the two
# never overlap: that run autotunes Triton kernels (their benchmarking synchronises the
# device), which a capture on another stream must not see. Reentrant: a compiled step is
# captured while the lock is held. The compile's tracing and code generation, minutes on the
# host, run without it.
DEVICE_WORK = threading.RLock()
# The background compile the current thread runs (background_compile.BackgroundCompile), if any.
background = threading.local()


def gated_backend(backend: str) -> Callable[..., Any]:
    """The compiler backend ``backend``; the runs of what it compiles on a background compile's
    thread are made by that compile (``BackgroundCompile.on_device``: under
    :data:`DEVICE_WORK`, unless stopped), elsewhere they run as they are."""
    from torch._dynamo import lookup_backend

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = lookup_backend(backend)(graph, example_inputs)

        def run(*args: Any) -> Any:
            job = getattr(background, "job", None)
            if job is None:
                return compiled(*args)
            return job.on_device(compiled, args)

        # The calling convention Dynamo uses (the arguments as one list, or spread) is the
        # compiled function's: keep it.
        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    return compile_graph


def compiled_forward() -> StepForward:
    """:func:`decode_forward` through ``torch.compile``, shape-generic: one compiled function
    for every decoder and window, on any thread."""
    global _compiled_forward
    if _compiled_forward is None:
        _compiled_forward = torch.compile(
            decode_forward, fullgraph=True, dynamic=True, backend=gated_backend(STEP_BACKEND)
        )
    return _compiled_forward


def step_view(model: PreTrainedModel, attention: str, groups: list[LinearGroup]) -> Any:
    """A view of ``model`` for the compiled step (see the module docstring): a copy of each
    module sharing its parameters and buffers (weight syncs and moves reach it), a copy of the
    config with attention ``attention``, and copies of the stacked projections ``groups``
    (their stacked weights shared), always active."""
    from transformers import PretrainedConfig

    _register_attention()  # the config's setter accepts registered names only
    copied: dict[int, Any] = {}  # the config and its sub-configs, by the original's id
    config = copy.deepcopy(model.config, copied)
    config._attn_implementation = attention
    views: dict[int, torch.nn.Module] = {}
    own_groups: dict[int, LinearGroup] = {}

    def view(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in views:  # a module held twice stays one
            return views[id(module)]
        new = views[id(module)] = copy.copy(module)
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        new._modules = {
            name: None if child is None else view(child) for name, child in module._modules.items()
        }
        for name, value in vars(module).items():
            if name.startswith("_") and "hooks" in name and isinstance(value, dict):
                # Its own hooks: one added to the model later (routing capture) stays off the
                # compiled step, which would otherwise trace it or compile again.
                setattr(new, name, type(value)(value))
            elif isinstance(value, PretrainedConfig) and id(value) in copied:
                setattr(new, name, copied[id(value)])
            elif isinstance(value, types.MethodType) and value.__self__ is module:
                # A forward set on the instance (a grouped projection's): bound to the copy.
                setattr(new, name, types.MethodType(value.__func__, new))
        group = getattr(module, "posttrain_group", None)
        if group is not None:
            if id(group) not in own_groups:
                # The same stacked tensors (weights and adapters), a state of its own.
                own = own_groups[id(group)] = copy.copy(group)
                own.active, own.pending = True, None
            new.posttrain_group = own_groups[id(group)]
        return new

    return view(model)


_row_slot_layer: type[StaticLayer] | None = None


def row_slot_layer(max_cache_len: int, write_slots: torch.Tensor) -> StaticLayer:
    """A transformers ``StaticLayer`` whose one-token steps write each row's keys and values at
    that row's slot ``write_slots[row]`` (transformers' layer writes every row at one shared
    slot); a longer input (the prefill) fills the first slots of every row. One class for
    every decoder: the compiled step is shape-generic, and a class of its own per decoder
    would compile it again."""
    global _row_slot_layer
    if _row_slot_layer is None:
        from transformers.cache_utils import StaticLayer

        class RowSlotLayer(StaticLayer):
            def update(
                self,
                key_states: torch.Tensor,
                value_states: torch.Tensor,
                *args: Any,
                **kwargs: Any,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                length = key_states.shape[-2]
                if length == 1:
                    # An index_put (not a scatter): inductor writes it in place, where a
                    # scatter_ compiled to a copy of the whole cache at every layer and step
                    # (the step at half speed: 1.5B, 256 rows, H200).
                    rows = torch.arange(key_states.shape[0], device=key_states.device)
                    slots = self.write_slots.view(-1)
                    self.keys[rows, :, slots] = key_states[:, :, 0]
                    self.values[rows, :, slots] = value_states[:, :, 0]
                else:
                    self.keys[:, :, :length] = key_states
                    self.values[:, :, :length] = value_states
                return self.keys, self.values

        _row_slot_layer = RowSlotLayer
    layer = _row_slot_layer(max_cache_len=max_cache_len)
    layer.write_slots = write_slots
    return layer


def row_slot_cache(model: PreTrainedModel, length: int, write_slots: torch.Tensor) -> Cache:
    from transformers import Cache

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[row_slot_layer(length, write_slots) for _ in range(layers)])


@attrs.frozen(kw_only=True)
class DecodeSettings:
    """How a decoder runs its steps (from ``hf_infer``'s ``strategy_config``)."""

    graph: bool  # the one-token step captured in a CUDA graph per window
    compiled: bool  # the step through torch.compile (before its capture)
    fuse_projections: bool  # q/k/v and gate/up as one GEMM each (fused_linears)
    attention: str  # the one-token steps' attention: "auto", "triton", "cudnn", "sdpa"


class StaticDecoder:
    """A static KV cache of ``rows x length`` tokens and the step's fixed-address inputs; with
    ``settings.graph``, the one-token step captured in a CUDA graph at its first call.
    ``groups``: the model's stacked projections (fused_linears), used in every forward here."""

    def __init__(
        self,
        model: PreTrainedModel,
        rows: int,
        length: int,
        device: torch.device | str,
        settings: DecodeSettings,
        groups: list[LinearGroup],
    ) -> None:
        _register_attention()
        self.model = model
        self.rows, self.length = rows, length
        # Each row's query slot: where its next token's keys and values go.
        self.current = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.cache = row_slot_cache(model, length, self.current)
        self.cache_argument = cache_argument(model)
        self.visible = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.advance = torch.zeros(rows, 1, dtype=torch.long, device=device)  # 1: running
        self.slots = torch.arange(length, device=device)
        self.attention = step_attention(settings.attention, model, device)
        self.groups = groups
        self.use_graph = settings.graph
        self.step_forward: StepForward = compiled_forward() if settings.compiled else decode_forward
        # A mixture-of-experts model's routing at each row's slots, written by the steps
        # (moe_decode); its forward passes here all run on the view, which writes it.
        self.routing: RoutingSlots | None = None
        if is_moe(model):
            self.routing = RoutingSlots(model, rows, length, self.current, self.advance)
        # What the compiled step runs on (its own view, see the module docstring).
        self.step_model = model
        if settings.compiled or self.routing is not None:
            self.step_model = step_view(model, self.attention, groups)
        if self.routing is not None:
            moe_decode.install(self.step_model, self.routing)
        # On the host: the latest query slot among the running rows, or later (exact after
        # :meth:`observe`): it picks the window without waiting for the GPU.
        self.latest_slot = 0
        # Per window: the captured step and its output buffer.
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def window(self, last_query: int) -> int:
        """Slots a query at cache slot ``last_query`` (or before) attends to."""
        return min(round_up(last_query + 1, WINDOW_BUCKET), self.length)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        queries: torch.Tensor,
        window: int,
        forward: StepForward,
    ) -> torch.Tensor:
        args = (
            {self.cache_argument: self.cache},
            self.visible,
            self.slots,
            ids,
            positions,
            queries,
            window,
        )
        if self.routing is not None:  # the view: its attention and projections are its own
            return forward(self.step_model, *args)
        with attention_of(self.model, self.attention), stacked_projections(self.groups):
            return forward(self.model, *args)

    def prefill(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts ``[rows, width]`` into an emptied cache; the logits of
        their last position ``[rows, vocab]``."""
        width = input_ids.shape[1]
        self.cache.reset()
        positions = prompt_positions(attention)
        self._place(slice(None), attention, positions)
        # Every row writes its routing (a one-token prompt's prefill writes as a step does).
        self.advance.fill_(1)
        self.latest_slot = width - 1
        queries, window = self.slots[None, :width], self.window(width - 1)
        return self._forward(input_ids, positions, queries, window, decode_forward)

    def refill(
        self, rows: list[int], input_ids: torch.Tensor, attention: torch.Tensor
    ) -> torch.Tensor:
        """Put the left-padded prompts ``[len(rows), width]`` into ``rows`` of the running cache
        (the other rows untouched): they run through the model on their own, with the model's
        own attention and a growing cache, and their keys and values are copied into the rows'
        first slots. The logits of their last position ``[len(rows), vocab]``."""
        from transformers import DynamicCache

        width = input_ids.shape[1]
        own = DynamicCache(config=self.model.config)
        positions = prompt_positions(attention)
        index = torch.tensor(rows, device=input_ids.device)

        def run() -> Any:
            with stacked_projections(self.groups):
                return self.model(
                    input_ids=input_ids,
                    attention_mask=attention,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_argument: own},
                )

        out = run() if self.routing is None else self.routing.refilled(self.model, index, run)
        for layer, prefilled in zip(self.cache.layers, own.layers):
            layer.keys[index, :, :width] = prefilled.keys
            layer.values[index, :, :width] = prefilled.values
        self._place(index, attention, positions)
        self.latest_slot = max(self.latest_slot, width - 1)
        return out.logits[:, -1]

    def _place(
        self, index: slice | torch.Tensor, attention: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Rows ``index`` (all of them: ``slice(None)``) start from prompts left-padded to
        ``attention.shape[1]`` slots, ``positions`` their position ids: the slots they see,
        their next position, and their query slot (the prompt's last)."""
        width = attention.shape[1]
        self.visible[index, :width] = attention.bool()
        self.visible[index, width:] = True
        self.position[index] = positions[:, -1:]
        self.current[index] = width - 1

    def observe(self, running: torch.Tensor) -> None:
        """The latest query slot among the rows ``running`` (``[rows]`` bool), read from the
        device at a sync point (one number). A row that stopped no longer holds the window
        open: what it computes is not read (its query still sees its own visible slots, or with
        none in the window, the mask's finite minimum everywhere: no NaN)."""
        self.latest_slot = int(torch.where(running, self.current.view(-1), 0).max())

    def step(self, tokens: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``[rows]``); the rows ``running`` (``[rows]`` bool) move to
        their next slot, the others stay where they stopped (what they compute there is not
        read). The next logits ``[rows, vocab]`` (with a graph, the graph's output buffer: read
        it before the next step)."""
        self.token.copy_(tokens.view(-1, 1))
        self.advance.copy_(running.view(-1, 1))
        self.position.add_(self.advance)
        self.current.add_(self.advance)
        self.latest_slot = min(self.latest_slot + 1, self.length - 1)
        window = self.window(self.latest_slot)
        if not self.use_graph:
            return self._step_forward(window)
        if window not in self.graphs:
            return self._capture(window)
        graph, logits = self.graphs[window]
        graph.replay()
        return logits

    def _capture(self, window: int) -> torch.Tensor:
        """The first step of a window runs eagerly on a side stream (CUDA graphs' warm-up:
        libraries initialise lazily), then the same step is captured; capturing runs nothing,
        so the cache is as the eager step left it."""
        if not DEVICE_WORK.acquire(blocking=False):
            # A background compile's step is on the device: this step runs ungraphed, and the
            # window is captured at a later step.
            return self._step_forward(window)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._step_forward(window)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: work other threads of the process queue meanwhile (a background
            # compile's tracing and code generation) is not an error.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                output = self._step_forward(window)
        finally:
            DEVICE_WORK.release()
        self.graphs[window] = (graph, output)
        return logits

    def compiled_step(self, window: int) -> torch.Tensor:
        """The one-token step through the compiled function, on the model's view."""
        return self.step_forward(
            self.step_model,
            {self.cache_argument: self.cache},
            self.visible,
            self.slots,
            self.token,
            self.position,
            self.current,
            window,
        )

    def _step_forward(self, window: int) -> torch.Tensor:
        args = self.token, self.position, self.current, window
        if self.step_forward is decode_forward:
            return self._forward(*args, decode_forward)
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self.compiled_step(window)
        except TorchDynamoException as error:
            # A model torch.compile cannot take whole (custom code it cannot trace): the same
            # step, uncompiled, still runs in the graph. Nothing ran before the failure.
            LOG.warning("hf_infer: the decode step does not compile (%s): it runs eagerly", error)
            self.step_forward = decode_forward
            return self._forward(*args, decode_forward)


class StaticDecoders:
    """The decoders of recent shapes (see the module docstring), oldest dropped first."""

    def __init__(self, settings: DecodeSettings, groups: list[LinearGroup]) -> None:
        # groups: the model's stacked projections (none unless settings.fuse_projections)
        self.settings, self.groups = settings, groups
        self._decoders: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()

    def get(
        self, model: PreTrainedModel, rows: int, length: int, device: torch.device | str
    ) -> StaticDecoder:
        key = (round_up(rows, ROWS_BUCKET), round_up(length, LENGTH_BUCKET))
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            while len(self._decoders) >= KEPT_SHAPES:
                self._decoders.popitem(last=False)
            decoder = StaticDecoder(model, *key, device, self.settings, self.groups)
        self._decoders[key] = decoder
        return decoder
