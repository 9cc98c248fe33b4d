"""Data passed between the driver and worker ranks.

Tensors here are CPU tensors when they cross a process boundary. Sequences are right-padded:
``input_ids[b, :lengths[b]]`` is sample ``b`` (prompt then response). Per-token values (log-probs,
advantages) are aligned with the token they score: ``logprobs[b, t]`` is the log-prob of
``input_ids[b, t]`` given the tokens before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen(kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    # A sample ends with the token that completes one of these strings (vLLM's ``stop``): the
    # response keeps that token and its log-prob; its text is cut where the string begins.
    stop: tuple[str, ...] = ()
    # Sample past the end-of-sequence token (``stop_token_ids`` and ``stop`` still apply).
    ignore_eos: bool = False


def stop_string_start(text: str, stop: Iterable[str]) -> int | None:
    """Where ``text`` is cut for stop strings, as vLLM cuts its output text: at the start of the
    stop string that completes first (the earlier one in ``stop`` on a tie); ``None`` if none
    occurs."""
    best_end = best_start = None
    for string in stop:
        start = text.find(string)
        if start >= 0 and (best_end is None or start + len(string) < best_end):
            best_end, best_start = start + len(string), start
    return best_start


@attrs.frozen(kw_only=True)
class ImageInputs:
    """One prompt's images as the model's image processor made them, once, on the driver:
    the rollout and the trainer feed these same tensors (Qwen2-VL style: the patches of all the
    prompt's images in one ``[patches, dim]`` tensor, and each image's ``[t, h, w]`` grid)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


# Per-sample tensors of a SequenceBatch whose dimension 1 is not the token axis: trimming to the
# tokens leaves them whole, and concatenation pads them to their own widest.
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@attrs.frozen(kw_only=True)
class GenerationRequest:
    prompt_ids: list[list[int]]
    sampling: SamplingParams
    # Seed for this request on this rank: makes rollouts reproducible across resumes.
    seed: int | None = None
    # Return each sample's routing (RolloutSamples.routing): mixture-of-experts models only.
    return_routing: bool = False
    # Vision-language models: per prompt, its images (None: a prompt without one). None: none.
    images: list[ImageInputs | None] | None = None


@attrs.define(kw_only=True)
class RolloutSamples:
    """``n`` samples per prompt, grouped: samples ``i*n .. i*n+n-1`` belong to prompt ``i``."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    # Per response token: 1 where the policy sampled it, 0 where an environment inserted it
    # (multi-turn episodes; those tokens are not trained on). None: the policy sampled all.
    loss_mask: list[list[int]] | None = None
    # Per response token: the policy version that sampled it (partial rollouts, whose samples
    # may span weight syncs; see posttrain.rollout.partial). None: not recorded.
    policy_versions: list[list[int]] | None = None
    # Mixture-of-experts models, for routing replay (algorithm.routing_replay): per sample, the
    # experts each token (prompt then response) was routed to, [tokens, moe_layers, k] in
    # uint8 (int16 past 256 experts). None: not recorded.
    routing: list[torch.Tensor] | None = None
    # Vision-language models: per sample, its prompt's images (the request's, as they were).
    images: list[ImageInputs | None] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def loss_masks(self) -> list[list[int]]:
        """``loss_mask``, with all ones where it is None."""
        if self.loss_mask is not None:
            return self.loss_mask
        return [[1] * len(r) for r in self.response_ids]

    def select(self, rows: list[int]) -> RolloutSamples:
        return RolloutSamples(
            prompt_ids=[self.prompt_ids[r] for r in rows],
            response_ids=[self.response_ids[r] for r in rows],
            response_logprobs=[self.response_logprobs[r] for r in rows],
            loss_mask=None if self.loss_mask is None else [self.loss_mask[r] for r in rows],
            policy_versions=(
                None if self.policy_versions is None else [self.policy_versions[r] for r in rows]
            ),
            routing=None if self.routing is None else [self.routing[r] for r in rows],
            images=None if self.images is None else [self.images[r] for r in rows],
        )

    @classmethod
    def concat(cls, parts: Iterable[RolloutSamples]) -> RolloutSamples:
        parts = list(parts)
        masked = any(part.loss_mask is not None for part in parts)
        # Every part of a step comes from the same kind of rollout: versions in all, or none.
        versions = [part.policy_versions for part in parts]
        # Routing is kept when every part holding samples has it (a rank with no prompts
        # returns none).
        routed = [part.routing for part in parts if len(part)]
        imaged = [part.images for part in parts if len(part)]
        return cls(
            prompt_ids=[p for part in parts for p in part.prompt_ids],
            response_ids=[r for part in parts for r in part.response_ids],
            response_logprobs=[lp for part in parts for lp in part.response_logprobs],
            loss_mask=[m for part in parts for m in part.loss_masks()] if masked else None,
            policy_versions=(
                [v for rows in versions if rows is not None for v in rows]
                if parts and None not in versions
                else None
            ),
            routing=(
                [r for rows in routed if rows is not None for r in rows]
                if routed and None not in routed
                else None
            ),
            images=(
                [i for rows in imaged if rows is not None for i in rows]
                if imaged and None not in imaged
                else None
            ),
        )


@attrs.define
class SequenceBatch:
    """A padded batch of token sequences with per-token tensors ([B, T], or [B, T, ...] such as
    ``routing``'s [B, T, moe_layers, k]) and per-sample ones ([B]).

    Required keys: ``input_ids``, ``attention_mask``, ``response_mask`` (1 on the response
    tokens the policy sampled; 0 on the prompt, padding and tokens an environment inserted).
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = attrs.field(factory=dict)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.tensors["attention_mask"]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.tensors["response_mask"]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def with_tensors(self, **extra: torch.Tensor) -> SequenceBatch:
        return SequenceBatch({**self.tensors, **extra}, dict(self.meta))

    def select(self, indices: list[int]) -> SequenceBatch:
        import torch

        index = torch.as_tensor(indices, dtype=torch.long)
        return SequenceBatch(
            {k: v.index_select(0, index) for k, v in self.tensors.items()}, dict(self.meta)
        )

    def split(self, parts: int) -> list[SequenceBatch]:
        """Split into ``parts`` contiguous shares of equal size (data-parallel dispatch)."""
        if len(self) % parts:
            raise ValueError(f"batch of {len(self)} cannot be split into {parts} equal shares")
        size = len(self) // parts
        return [self.select(list(range(i * size, (i + 1) * size))) for i in range(parts)]

    def sequences(self) -> list[list[int]]:
        """Each row's tokens without its padding (prompt then response)."""
        lengths = self.attention_mask.sum(dim=1).tolist()
        return [self.input_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]

    def trimmed(self) -> SequenceBatch:
        """Drop trailing columns that are padding in every row."""
        width = int(self.attention_mask.sum(dim=1).max().item())
        return SequenceBatch(
            {
                k: (v[:, :width] if v.dim() >= 2 and k not in IMAGE_KEYS else v)
                for k, v in self.tensors.items()
            },
            dict(self.meta),
        )

    @classmethod
    def concat(cls, batches: list[SequenceBatch]) -> SequenceBatch:
        import torch

        tokens = max(b.input_ids.shape[1] for b in batches)
        out: dict[str, torch.Tensor] = {}
        for key in batches[0].tensors:
            width = max(b.tensors[key].shape[1] for b in batches) if key in IMAGE_KEYS else tokens
            columns = []
            for b in batches:
                t = b.tensors[key]
                if t.dim() >= 2 and t.shape[1] < width:
                    # Pads dimension 1 (F.pad lists the last dimension first).
                    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))
                columns.append(t)
            out[key] = torch.cat(columns, dim=0)
        return cls(out, dict(batches[0].meta))


def concat_tensor_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [B_i, T_i] tensors along rows, right-padding to the widest."""
    import torch

    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], dim=0)


def build_sequence_batch(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_token_id: int,
    response_logprobs: list[list[float]] | None = None,
    loss_mask: list[list[int]] | None = None,
    turn_rewards: list[list[float]] | None = None,
    policy_versions: list[list[int]] | None = None,
    routing: list[torch.Tensor] | None = None,
    images: list[ImageInputs | None] | None = None,
) -> SequenceBatch:
    """Pack prompt + response pairs into a right-padded :class:`SequenceBatch`.

    With ``response_logprobs`` (the rollout's), also ``rollout_logprobs`` laid out like
    ``posttrain_compute_logprobs``'s answer (position t holds the log-prob of token t). A
    ``loss_mask`` (:attr:`RolloutSamples.loss_mask`) is ANDed into ``response_mask``, so the
    tokens environments inserted count for nothing downstream (loss, KL, entropy, advantages,
    values). ``turn_rewards`` (per response token: each turn's reward on its last model token)
    become the ``turn_rewards`` tensor that token-level advantage estimators read.
    ``policy_versions`` (partial rollouts: the version that sampled each response token)
    become the ``policy_version`` tensor, for losses and plugins that weigh tokens by age.
    ``routing`` (:attr:`RolloutSamples.routing`) becomes the ``routing`` tensor
    ``[B, T, moe_layers, k]`` (zeros on the padding), which routing replay replays.
    ``images`` (:attr:`RolloutSamples.images`) become the :data:`IMAGE_KEYS` tensors
    (:func:`image_tensors`).
    """
    import torch

    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    batch = len(lengths)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
    if loss_mask is None:
        loss_mask = [[1] * len(r) for r in response_ids]
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": _response_tensor(prompt_ids, loss_mask, width),
    }
    if response_logprobs is not None:
        tensors["rollout_logprobs"] = _response_tensor(prompt_ids, response_logprobs, width)
    if turn_rewards is not None:
        tensors["turn_rewards"] = _response_tensor(prompt_ids, turn_rewards, width)
    if policy_versions is not None:
        tensors["policy_version"] = _response_tensor(prompt_ids, policy_versions, width)
    if routing is not None:
        tensors["routing"] = routing_tensor(routing, lengths, width)
    if images is not None:
        tensors.update(image_tensors(images))
    return SequenceBatch(tensors)


def image_tensors(images: Sequence[ImageInputs | None]) -> dict[str, torch.Tensor]:
    """Per-sample images as two right-padded tensors: ``pixel_values`` ``[rows, patches, dim]``
    (zeros past a row's patches) and ``image_grid_thw`` ``[rows, images, 3]`` (zero rows past
    its images: a grid of 0 patches, which :func:`image_forward_inputs` skips)."""
    import torch

    present = [i for i in images if i is not None]
    if not present:
        raise ValueError("image_tensors: no sample has an image")
    dim = present[0].pixel_values.shape[1]
    patches = max((i.pixel_values.shape[0] for i in present), default=0)
    count = max((i.image_grid_thw.shape[0] for i in present), default=0)
    pixels = torch.zeros((len(images), patches, dim), dtype=present[0].pixel_values.dtype)
    grids = torch.zeros((len(images), count, 3), dtype=torch.long)
    for row, image in enumerate(images):
        if image is not None:
            pixels[row, : image.pixel_values.shape[0]] = image.pixel_values
            grids[row, : image.image_grid_thw.shape[0]] = image.image_grid_thw
    return {"pixel_values": pixels, "image_grid_thw": grids}


def image_forward_inputs(
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    config: Any,
) -> dict[str, torch.Tensor]:
    """A Qwen2-VL style model's inputs for rows ``input_ids`` from the :func:`image_tensors` of
    the same rows (``config``: the model's): every row's patches in one ``[patches, dim]``
    tensor, its images' grids, ``mm_token_type_ids`` (1 on image tokens, from which the model
    computes its multimodal rotary positions itself), and ``input_ids`` where an image token
    past the row's images (one the policy sampled) is :func:`shown_token` as the rollout fed
    it. A row whose ids hold no image token (a filler micro-batch cut short) shows no image."""
    import torch

    image_id = config.image_token_id
    merge = config.vision_config.spatial_merge_size**2
    ids = input_ids.clone()
    pixels, grids = [], []
    for row in range(len(ids)):
        grid = image_grid_thw[row]
        grid = grid[grid.prod(dim=-1) > 0]
        at = (ids[row] == image_id).nonzero().flatten()
        shown = int(grid.prod(dim=-1).sum()) // merge if len(at) else 0
        ids[row, at[shown:]] = shown_token(image_id, config)
        if shown:
            pixels.append(pixel_values[row, : int(grid.prod(dim=-1).sum())])
            grids.append(grid)
    if not grids:
        return {"input_ids": ids}
    return {
        "input_ids": ids,
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
        "mm_token_type_ids": (ids == image_id).int(),
    }


def shown_token(token: int, config: Any) -> int:
    """What a vision-language model is fed for ``token`` in a response: an image placeholder
    the policy sampled shows no image (its place would have no features), so it is fed as
    ``<|vision_end|>``; any other token as itself. The rollout feeds and the trainer scores
    alike."""
    return int(config.vision_end_token_id) if token == config.image_token_id else token


def routing_record(rows: list[torch.Tensor]) -> dict[str, Any]:
    """:attr:`RolloutSamples.routing` as JSON-ready values (a driver checkpoint keeps the
    batches made ahead as JSON): the samples' bytes in one base64 text, their shapes and dtype.
    :func:`routing_from_record` gives it back bitwise."""
    import base64

    import torch

    data = b"".join(row.contiguous().view(torch.uint8).numpy().tobytes() for row in rows)
    return {
        "dtype": str(rows[0].dtype).removeprefix("torch.") if rows else "uint8",
        "shapes": [list(row.shape) for row in rows],
        "data": base64.b64encode(data).decode("ascii"),
    }


def routing_from_record(record: dict[str, Any]) -> list[torch.Tensor]:
    """The per-sample routing :func:`routing_record` wrote."""
    import base64
    import math

    import torch

    if not record["shapes"]:
        return []
    dtype = getattr(torch, record["dtype"])
    flat = torch.frombuffer(bytearray(base64.b64decode(record["data"])), dtype=dtype)
    rows, at = [], 0
    for shape in record["shapes"]:
        size = math.prod(shape)
        rows.append(flat[at : at + size].view(*shape).clone())
        at += size
    return rows


def images_record(images: list[ImageInputs | None]) -> dict[str, Any]:
    """Per-sample :class:`ImageInputs` as JSON-ready values (bitwise, as
    :func:`routing_record` writes tensors); :func:`images_from_record` gives them back."""
    shown = [image for image in images if image is not None]
    return {
        "shown": [image is not None for image in images],
        "pixel_values": routing_record([image.pixel_values for image in shown]),
        "image_grid_thw": routing_record([image.image_grid_thw for image in shown]),
    }


def images_from_record(record: dict[str, Any]) -> list[ImageInputs | None]:
    """The per-sample images :func:`images_record` wrote."""
    pixels = iter(routing_from_record(record["pixel_values"]))
    grids = iter(routing_from_record(record["image_grid_thw"]))
    return [
        ImageInputs(pixel_values=next(pixels), image_grid_thw=next(grids)) if shown else None
        for shown in record["shown"]
    ]


def routing_tensor(rows: list[torch.Tensor], lengths: list[int], width: int) -> torch.Tensor:
    """Per-sample ``[tokens, moe_layers, k]`` routing in one right-padded
    ``[rows, width, moe_layers, k]`` tensor (its dtype kept)."""
    import torch

    first = rows[0]
    out = torch.zeros((len(rows), width, *first.shape[1:]), dtype=first.dtype)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        if row.shape[0] != length:
            raise ValueError(f"routing of sample {i}: {row.shape[0]} tokens for {length}")
        out[i, :length] = row
    return out


def _response_tensor(
    prompt_ids: list[list[int]], values: Sequence[Sequence[float]], width: int
) -> torch.Tensor:
    """Per-response-token values in a float32 [rows, width] tensor, at their tokens' positions
    (0 on the prompt and the padding)."""
    import torch

    out = torch.zeros((len(prompt_ids), width), dtype=torch.float32)
    for i, (p, row) in enumerate(zip(prompt_ids, values)):
        out[i, len(p) : len(p) + len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


@attrs.define
class WeightBucket:
    """HF-named full tensors moved together in one weight-sync transfer."""

    tensors: list[tuple[str, torch.Tensor]] = attrs.field(factory=list)
    # Per tensor, the sum of its bytes as the trainer's engine exported it, when this sync
    # checks this bucket (posttrain.weight_sync.verify); None: not checked.
    digests: list[int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def __bool__(self) -> bool:
        return bool(self.tensors)


def fused_group(name: str) -> str:
    """The module whose weights must travel together: q/k/v share ``...self_attn``, gate/up
    share ``...mlp`` (engines fuse them; a bucket holding only part of them yields NaNs)."""
    parts = name.split(".")
    # "model.layers.3.self_attn.q_proj.weight" -> "model.layers.3.self_attn"; top-level weights
    # such as "model.embed_tokens.weight" travel on their own.
    return ".".join(parts[:-2]) if len(parts) > 3 else name


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[WeightBucket]:
    """Group tensors into buckets of about ``bucket_bytes``, never splitting a fused group."""
    bucket = WeightBucket()
    group: list[tuple[str, torch.Tensor]] = []
    group_key = None
    for name, tensor in named_tensors:
        key = fused_group(name)
        if group and key != group_key:
            if bucket and bucket.nbytes + _nbytes(group) > bucket_bytes:
                yield bucket
                bucket = WeightBucket()
            bucket.tensors.extend(group)
            group = []
        group_key = key
        group.append((name, tensor))
    if group:
        if bucket and bucket.nbytes + _nbytes(group) > bucket_bytes:
            yield bucket
            bucket = WeightBucket()
        bucket.tensors.extend(group)
    if bucket:
        yield bucket


def _nbytes(group: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in group)
