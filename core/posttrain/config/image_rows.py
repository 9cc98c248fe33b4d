"""Data rows with images (vision-language prompts): how an image is given (a path relative to
the data file, base64 text, or bytes) and what makes a row unusable, checked by validation
before anything starts and again where the prompts are processed (posttrain.tasks.vision).

A prompt names each of its images by the placeholder :data:`IMAGE_PAD`, as Qwen2-VL's chat
template writes it (``<|vision_start|><|image_pad|><|vision_end|>``).
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

IMAGE_PAD = "<|image_pad|>"
# The key of a row's images.
IMAGES_KEY = "images"


def decode_image(value: Any, base_dir: str) -> Image.Image:
    """A data row's image: a PIL image, bytes (Parquet), a ``data:...;base64,`` URI or bare
    base64 text, or a path (relative to the data file's folder). Raises ValueError with the
    reason when it cannot be read or decoded."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and "bytes" in value:  # Parquet's image struct
        value = value["bytes"]
    if isinstance(value, str):
        if value.startswith("data:") and ";base64," in value:
            value = base64.b64decode(value.split(";base64,", 1)[1])
        elif not os.path.splitext(value)[1] and len(value) > 64:
            try:
                value = base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("neither a path nor base64 text") from None
        else:
            path = value if os.path.isabs(value) else os.path.join(base_dir, value)
            if not os.path.exists(path):
                raise ValueError(f"file not found: {path}")
            with open(path, "rb") as f:
                value = f.read()
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"an image is a path, base64 text or bytes, not {type(value).__name__}")
    try:
        image = Image.open(io.BytesIO(value))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode the image ({exc})") from None
    return image.convert("RGB")


def image_row_problem(record: dict[str, Any], prompt_key: str, base_dir: str) -> str | None:
    """What is wrong with a data row's images, or None: one that cannot be read or decoded,
    or a prompt whose :data:`IMAGE_PAD` placeholders do not number its images."""
    images = record.get(IMAGES_KEY) or []
    if not isinstance(images, list):
        return "'images' is a list of paths, base64 texts or bytes"
    for index, value in enumerate(images):
        try:
            decode_image(value, base_dir)
        except ValueError as exc:
            return f"image {index}: {exc}"
    placeholders = str(record.get(prompt_key, "")).count(IMAGE_PAD)
    if placeholders != len(images):
        return (
            f"the prompt has {placeholders} image placeholder(s) {IMAGE_PAD} for "
            f"{len(images)} image(s)"
        )
    return None


def image_row_problems(
    path: str, prompt_key: str, base_dir: str, limit: int = 5
) -> list[tuple[int, str]]:
    """``(row number, problem)`` of the first ``limit`` rows of the JSONL or Parquet file at
    ``path`` whose images are unusable (rows numbered from 1, as a line number). Rows that
    neither list images nor hold a placeholder are not parsed here: a text dataset costs a
    scan of its lines."""
    found: list[tuple[int, str]] = []
    for number, row in _image_rows(path, prompt_key):
        problem = image_row_problem(row, prompt_key, base_dir)
        if problem is not None:
            found.append((number, problem))
            if len(found) == limit:
                break
    return found


def _image_rows(path: str, prompt_key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number, row)`` of the rows that list images or hold a placeholder."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        columns = [c for c in (prompt_key, IMAGES_KEY) if c in names]
        if IMAGES_KEY not in names and prompt_key not in names:
            return
        rows = pq.read_table(path, columns=columns).to_pylist()
        for number, row in enumerate(rows, 1):
            if row.get(IMAGES_KEY) or IMAGE_PAD in str(row.get(prompt_key)):
                yield number, row
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if f'"{IMAGES_KEY}"' not in line and IMAGE_PAD not in line:
                continue
            row = _json_or_none(line)  # an invalid JSON line is reported where data is read
            if isinstance(row, dict) and (
                row.get(IMAGES_KEY) or IMAGE_PAD in str(row.get(prompt_key))
            ):
                yield number, row


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None
