"""Vision-language prompts (Qwen2-VL style): images decoded from data rows or drawn by a
synthetic task, processed once into token ids and :class:`~posttrain.protocol.ImageInputs`,
and the tiny Qwen2-VL preset posttrain builds locally.

A prompt names each of its images by the placeholder :data:`IMAGE_PAD` (as Qwen2-VL's chat
template writes it, ``<|vision_start|><|image_pad|><|vision_end|>``); processing expands each
placeholder into as many image tokens as the image has merged patches, as transformers'
``Qwen2VLProcessor`` does. transformers 5's ``AutoProcessor`` for Qwen2-VL needs torchvision (its
video processor), so posttrain runs the model's own image processor (``AutoImageProcessor``,
saved beside the weights) and the role's tokenizer itself: the same ids and pixels.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from posttrain.config.image_rows import IMAGE_PAD
from posttrain.errors import UserError

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain.protocol import ImageInputs

# Supervised steps of the warm-started preset (tiny-qwen2-vl-count).
VISION_WARM_STEPS = 100
VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IMAGE_PLACEHOLDER = f"{VISION_START}{IMAGE_PAD}{VISION_END}"

# count_shapes: a 32x32 image of 2x2 cells of 16 pixels, each empty, red or blue. With the tiny
# preset's 8-pixel patches merged 2x2, each cell is exactly one image token.
CELL, CELLS = 16, 2
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220)}


def draw_cells(cells: tuple[str | None, ...]) -> Image.Image:
    """The image of ``cells`` (row-major; a colour name or None), a square inset in each."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CELL * CELLS, CELL * CELLS), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for index, colour in enumerate(cells):
        if colour is not None:
            x, y = CELL * (index % CELLS), CELL * (index // CELLS)
            pen.rectangle((x + 2, y + 2, x + CELL - 3, y + CELL - 3), fill=COLOURS[colour])
    return image


def count_shapes(count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """How many red squares: every layout of empty, red and blue cells (81), shuffled by
    ``seed``, or ``count`` of them drawn with repeats. The answer is the digit 0-4; a guess is
    right about 1 time in 5."""
    import itertools

    layouts = list(itertools.product((None, "red", "blue"), repeat=CELLS * CELLS))
    rng = random.Random(seed)
    rng.shuffle(layouts)
    if count is not None:
        layouts = [layouts[i % len(layouts)] for i in range(count)]
    return [
        {
            "prompt": f"{IMAGE_PLACEHOLDER}=",
            "answer": str(sum(c == "red" for c in cells)),
            "images": [draw_cells(cells)],
        }
        for cells in layouts
    ]


def load_image_processor(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The model's image processor, saved beside its tokenizer (``tokenizer.name_or_path``)."""
    from transformers import AutoImageProcessor

    from posttrain.hf_progress import no_hf_progress_bars

    with no_hf_progress_bars():
        try:
            return AutoImageProcessor.from_pretrained(tokenizer.name_or_path)
        except OSError as exc:
            raise UserError(
                f"data rows have images but {tokenizer.name_or_path} has no image processor "
                f"({exc}); use a vision-language model"
            ) from None


def process_prompt(
    text: str,
    images: list[Image.Image],
    tokenizer: PreTrainedTokenizerBase,
    image_processor: Any,
    add_special_tokens: bool = True,
) -> tuple[list[int], ImageInputs]:
    """``text``'s token ids, each :data:`IMAGE_PAD` expanded to its image's tokens, and the
    images' processor inputs, as ``Qwen2VLProcessor`` makes them. ``add_special_tokens=False``
    for a text a chat template rendered (it holds the special tokens the model wants)."""
    from posttrain.protocol import ImageInputs

    out = image_processor(images=images, return_tensors="pt")
    grids = out["image_grid_thw"]
    merge = int(getattr(image_processor, "merge_size", 2)) ** 2
    parts = text.split(IMAGE_PAD)
    expanded = parts[0]
    for grid, part in zip(grids, parts[1:]):
        expanded += IMAGE_PAD * (int(grid.prod()) // merge) + part
    ids = tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
    inputs = ImageInputs(pixel_values=out["pixel_values"].float(), image_grid_thw=grids.long())
    return list(ids), inputs


def build_vision_model(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> tuple[PreTrainedModel, Any]:
    """A Qwen2-VL model with a one-block vision tower of 8-pixel patches (merged 2x2) and its
    image processor (32x32 images: 4 image tokens each)."""
    import transformers

    token = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_attention_heads
    # mrope: the rotary half-dimensions split over time, height and width.
    quarter = head_dim // 2 // 4
    config = transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "max_position_embeddings": max_position_embeddings,
            "rope_scaling": {
                "type": "mrope",
                "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter],
            },
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=token(IMAGE_PAD),
        video_token_id=token(VIDEO_PAD),
        vision_start_token_id=token(VISION_START),
        vision_end_token_id=token(VISION_END),
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2VLForConditionalGeneration(config)
    pixels = CELL * CELLS * CELL * CELLS
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=8,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=pixels,
        max_pixels=pixels,
    )
    return model, processor


def warm_start_count_shapes(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, image_processor: Any, steps: int
) -> None:
    """Supervised steps on count_shapes answers (the answer digit after the prompt), the whole
    model trained. About 100 steps of 16 take it from the answers' marginal (about 0.3 of
    sampled answers right) to where it starts to count (about 0.4); 200 count almost always."""
    import torch

    samples = []
    for record in count_shapes(seed=1):
        ids, inputs = process_prompt(record["prompt"], record["images"], tokenizer, image_processor)
        samples.append((ids, tokenizer.convert_tokens_to_ids(record["answer"]), inputs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(samples, 16)
        ids = torch.tensor([p for p, _, _ in batch])
        out = model(
            input_ids=ids,
            pixel_values=torch.cat([i.pixel_values for _, _, i in batch]),
            image_grid_thw=torch.cat([i.image_grid_thw for _, _, i in batch]),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        )
        answers = torch.tensor([a for _, a, _ in batch])
        torch.nn.functional.cross_entropy(out.logits[:, -1], answers).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
