"""Engine side of ``hf_infer``: sampling with per-token log-probs, and sequence scoring.

Reported log-probs are those of the model's own distribution (temperature 1, before top-k/top-p),
as vLLM and SGLang report them by default, so they compare directly with a trainer's forward pass.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from posttrain.backends.hf_progress import no_hf_progress_bars
from posttrain.backends.models import load_model_with_head, load_tokenizer
from posttrain.backends.plumbing import is_cuda, log_once, memory_tags
from posttrain.backends.static_decode import (
    StaticDecoders,
    cache_argument,
    supports_static,
)
from posttrain.backends.tensors import unshare_storage
from posttrain.backends.token_sampling import draw, gumbel_draw, is_plain
from posttrain.protocol import (
    GenerationRequest,
    RolloutSamples,
    SequenceBatch,
    WeightBucket,
    stop_string_start,
)
from posttrain.scoring.logprob_head import TokenLogprobs, logprob_forward
from posttrain.scoring.modeling import sequence_scores, shifted_token_logprobs

if TYPE_CHECKING:
    from posttrain.launch.worker import WorkerContext

LOG = logging.getLogger(__name__)


def setup_parallel(worker: WorkerContext) -> dict[str, int]:
    # Every rank is an independent replica: no process group is needed.
    return {"dp_rank": worker.rank, "dp_size": worker.world_size}


def load_model(worker: WorkerContext):
    model = load_model_with_head(worker.model_args, worker.head, worker.base_dir, worker.device)
    model.eval()
    worker.state["tokenizer"] = load_tokenizer(worker.model_args, worker.base_dir)
    return model


def _batch_size(worker: WorkerContext) -> int:
    return worker.state.get("infer_batch_size") or worker.config.batch_size


@torch.no_grad()
def generate(worker: WorkerContext, request: GenerationRequest) -> RolloutSamples:
    sampling = request.sampling
    tokenizer = worker.state["tokenizer"]
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids.add(tokenizer.eos_token_id)
    generator = torch.Generator(device=worker.device)
    generator.manual_seed(request.seed if request.seed is not None else worker.seed)
    prompts = [list(p) for p in request.prompt_ids for _ in range(sampling.n)]
    step = _batch_size(worker) * sampling.n
    # Batches of prompts of similar lengths (less left padding to run through the model), when
    # there are several; the samples go back in the request's order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    if len(prompts) <= step:
        order = list(range(len(prompts)))
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    mode = decode_mode(worker)
    draw_token = _drawer(mode, sampling, generator)
    for start in range(0, len(order), step):
        rows = order[start : start + step]
        chunk = [prompts[i] for i in rows]
        decode = _start_decode(worker, mode, chunk, sampling.max_new_tokens, tokenizer.pad_token_id)
        tokens, token_logps = _sample(decode, len(chunk), sampling, stop_ids, tokenizer, draw_token)
        for i, ids, logps in zip(rows, tokens, token_logps):
            responses[i], logprobs[i] = ids, logps
    return RolloutSamples(prompt_ids=prompts, response_ids=responses, response_logprobs=logprobs)


def decode_mode(worker: WorkerContext) -> str:
    """``strategy_config.decode`` resolved: ``auto`` is ``compiled`` on a GPU, ``dynamic``
    on the CPU; a model with other than full-attention layers decodes dynamically."""
    mode = worker.config.decode
    on_gpu = is_cuda(worker)
    if mode == "auto":
        mode = "compiled" if on_gpu else "dynamic"
    if mode == "cuda_graph" and not on_gpu:
        mode = "static"  # CUDA graphs need a GPU; the same fixed-shape step runs eagerly
    if mode != "dynamic" and not supports_static(worker.model):
        log_once(
            LOG,
            f"hf_infer: {type(worker.model).__name__} has layers other than full attention: "
            "it decodes with the dynamic cache",
            logging.WARNING,
        )
        mode = "dynamic"
    return mode


def _left_padded(prompts: list[list[int]], rows: int, pad_id: int, device):
    """``[rows, width]`` token ids and attention mask, the prompts right-aligned (rows past
    the prompts are all padding)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((rows, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, device=device)
        attention[i, width - len(p) :] = 1
    return input_ids, attention


def _drawer(mode: str, sampling, generator):
    """The step's sampling: fused (:func:`gumbel_draw`) in the compiled decode where the
    sampling is plain, else the general :func:`draw`."""
    if mode == "compiled" and is_plain(sampling):
        return lambda logits: gumbel_draw(logits, sampling.temperature, generator)
    return lambda logits: draw(logits, sampling, generator)


def _start_decode(worker: WorkerContext, mode: str, prompts, max_new_tokens: int, pad_id: int):
    if mode == "dynamic":
        input_ids, attention = _left_padded(prompts, len(prompts), pad_id, worker.device)
        return DynamicDecode(worker.model, input_ids, attention)
    on_gpu = is_cuda(worker)
    graph, compiled = mode in ("cuda_graph", "compiled") and on_gpu, mode == "compiled"
    decoders = worker.state.get("decoders")
    if decoders is None or (decoders.graph, decoders.compiled) != (graph, compiled):
        decoders = worker.state["decoders"] = StaticDecoders(graph=graph, compiled=compiled)
    width = max(len(p) for p in prompts)
    decoder = decoders.get(worker.model, len(prompts), width + max_new_tokens, worker.device)
    input_ids, attention = _left_padded(prompts, decoder.rows, pad_id, worker.device)
    return StaticDecode(decoder, input_ids, attention, pad_id)


class DynamicDecode:
    """transformers' growing cache (as ``generate``): each step's shapes differ."""

    def __init__(self, model, input_ids: torch.Tensor, attention: torch.Tensor):
        from transformers import DynamicCache

        self.model = model
        self.cache = {cache_argument(model): DynamicCache(config=model.config)}
        self.attention = attention
        self.position = (attention.cumsum(-1) - 1).clamp(min=0)
        self.first = self._forward(input_ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention,
            position_ids=self.position,
            use_cache=True,
            logits_to_keep=1,
            **self.cache,
        )
        return out.logits[:, -1]

    def step(self, token: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        self.position = self.position[:, -1:] + 1
        self.attention = torch.cat([self.attention, (~finished).long().unsqueeze(-1)], dim=-1)
        return self._forward(token.unsqueeze(-1))


class StaticDecode:
    """One generation on a :class:`~posttrain.backends.static_decode.StaticDecoder` (its rows
    past the prompts decode padding, never read)."""

    def __init__(self, decoder, input_ids: torch.Tensor, attention: torch.Tensor, pad_id: int):
        self.decoder = decoder
        self.tokens = torch.full((decoder.rows,), pad_id, dtype=torch.long, device=input_ids.device)
        self.first = decoder.prefill(input_ids, attention)

    def step(self, token: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        self.tokens[: len(token)] = token
        return self.decoder.step(self.tokens)


# On a GPU, steps between the host's looks at which rows finished: in between it queues the next
# steps' kernels while the GPU runs the last ones (a look waits for the GPU to drain).
SYNC_EVERY = 8


def _sample(decode, batch: int, sampling, stop_ids, tokenizer, draw):
    """Sample up to ``max_new_tokens`` for the ``batch`` prompts ``decode`` started. Tokens and
    log-probs stay on the device until the end; a row's length counts its tokens up to and
    including the one that stopped it."""
    device = decode.first.device
    steps, pad_id = sampling.max_new_tokens, tokenizer.pad_token_id
    tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
    # Every step where the text must be read (stop strings) or looking costs nothing (the CPU).
    every = 1 if sampling.stop or device.type == "cpu" else SYNC_EVERY
    next_logits = decode.first
    for t in range(steps):
        token, token_logp = draw(next_logits[:batch])
        tokens[:, t] = token
        logps[:, t] = token_logp
        lengths += ~finished
        if stops is not None:
            finished |= torch.isin(token, stops)
        if sampling.stop:
            finished |= _stop_strings_reached(tokens, lengths, finished, sampling.stop, tokenizer)
        if t + 1 == steps or ((t + 1) % every == 0 and bool(finished.all())):
            break
        next_logits = decode.step(torch.where(finished, pad_id, token), finished)
    counts = lengths.tolist()
    responses = [row[:n] for row, n in zip(tokens.tolist(), counts)]
    logprobs = [row[:n] for row, n in zip(logps.tolist(), counts)]
    return responses, logprobs


def _stop_strings_reached(tokens, lengths, finished, stop: tuple[str, ...], tokenizer):
    """The rows still running whose text now contains a stop string. As vLLM: the text without
    special tokens; the token completing a stop string is the sample's last one. (Whole
    responses are decoded each step: simple, and cheap next to the forward pass at the lengths
    hf_infer serves.)"""
    running = [i for i, done in enumerate(finished.tolist()) if not done]
    counts, rows = lengths.tolist(), tokens.tolist()
    texts = tokenizer.batch_decode(
        [rows[i][: counts[i]] for i in running], skip_special_tokens=True
    )
    reached = torch.zeros_like(finished)
    for i, text in zip(running, texts):
        if stop_string_start(text, stop) is not None:
            reached[i] = True
    return reached


@torch.no_grad()
def _in_chunks(worker: WorkerContext, batch: SequenceBatch, score) -> torch.Tensor:
    """``score(ids, mask)`` over ``infer_batch_size`` rows at a time, concatenated on the host."""
    parts = []
    step = _batch_size(worker)
    for start in range(0, len(batch), step):
        ids = batch.input_ids[start : start + step].to(worker.device)
        mask = batch.attention_mask[start : start + step].to(worker.device)
        parts.append(score(ids, mask).cpu())
    return torch.cat(parts, dim=0)


def compute_logprobs(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    forward = logprob_forward(worker, worker.model, train=False)

    def logprobs(ids, mask):
        rows = SequenceBatch({"input_ids": ids, "attention_mask": mask})
        out = forward(rows)
        if isinstance(out, TokenLogprobs):
            return out.logprobs * mask
        return shifted_token_logprobs(out, ids) * mask

    return _in_chunks(worker, batch, logprobs)


def compute_scores(worker: WorkerContext, batch: SequenceBatch) -> torch.Tensor:
    return _in_chunks(worker, batch, lambda ids, mask: sequence_scores(worker.model, ids, mask))


def import_weights(worker: WorkerContext, buckets) -> bool:
    params = dict(worker.model.state_dict(keep_vars=True))
    with torch.no_grad():
        for bucket in buckets:
            for name, _ in bucket.tensors:
                if name not in params:
                    raise KeyError(f"hf_infer: the model has no weight named {name!r}")
            targets = [params[name].data for name, _ in bucket.tensors]
            sources = [tensor for _, tensor in bucket.tensors]
            if all(s.device == t.device for s, t in zip(sources, targets)):
                # One grouped copy (casting as needed) of a bucket already on the device (the
                # in-process hand-over): per-tensor copies cost more in launches than in bytes.
                torch._foreach_copy_(targets, sources)
            else:
                for target, source in zip(targets, sources):
                    target.copy_(source)
    return True


def save_checkpoint(worker: WorkerContext, path: str) -> dict:
    # An inference engine has no optimizer state; its weights are what a sync put there.
    if worker.rank == 0:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in worker.model.state_dict().items()}
        save_file(unshare_storage(state.items()), os.path.join(path, "model.safetensors"))
    return {"format": "safetensors"}


def load_checkpoint(worker: WorkerContext, path: str) -> bool:
    from safetensors.torch import load_file

    state = load_file(os.path.join(path, "model.safetensors"))
    return import_weights(worker, [WeightBucket(list(state.items()))])


def export_hf(worker: WorkerContext, path: str) -> bool:
    if worker.rank == 0:
        with no_hf_progress_bars():
            worker.model.save_pretrained(path, safe_serialization=True)
        worker.state["tokenizer"].save_pretrained(path)
    return True


def release_memory(worker: WorkerContext, tags: list[str]) -> bool:
    """Move the weights to host memory while a colocated role uses the device, when the
    config says so (``param_offload``)."""
    if worker.config.param_offload and "weights" in memory_tags(tags):
        # Captured decode graphs point at the weights' device memory, which the move frees.
        worker.state.pop("decoders", None)
        worker.model.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return True


def resume_memory(worker: WorkerContext, tags: list[str]) -> bool:
    if worker.config.param_offload and "weights" in memory_tags(tags):
        worker.model.to(worker.device)
    return True


def shutdown_worker(worker: WorkerContext) -> bool:
    return True
