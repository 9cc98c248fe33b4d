"""Data rows with images (vision-language prompts): validation names the YAML path and the row
of a missing file, an undecodable image or a placeholder count that does not match, before
anything starts; sound rows (a path relative to the data file, base64) are processed once into
ids and image inputs; the count_shapes task draws its images with an exact answer."""

from __future__ import annotations

import base64
import io
import json

import pytest

from posttrain.config.data_sections import DataConfig, SyntheticData, check_prompt_source
from posttrain.config.image_rows import IMAGE_PAD
from posttrain.config.report import ErrorReport

PROMPT = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>="


def _png(colour=(255, 0, 0)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(tmp_path, rows) -> str:
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "red.png").write_bytes(_png())
    (tmp_path / "img" / "broken.png").write_bytes(b"not an image")
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _errors(tmp_path, rows) -> list[str]:
    report = ErrorReport()
    check_prompt_source(DataConfig(path=_write(tmp_path, rows)), str(tmp_path), "data", report)
    return [f"{issue.path}: {issue.message}" for issue in report.errors]


def test_sound_rows_pass_validation(tmp_path):
    b64 = base64.b64encode(_png((0, 0, 255))).decode()
    rows = [
        {"prompt": PROMPT, "answer": "1", "images": ["img/red.png"]},
        {"prompt": PROMPT, "answer": "0", "images": [b64]},
        {"prompt": PROMPT, "answer": "0", "images": [f"data:image/png;base64,{b64}"]},
        {"prompt": "1+2=", "answer": "3"},
    ]
    assert _errors(tmp_path, rows) == []


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"images": ["img/missing.png"]}, "image 0: file not found"),
        ({"images": ["img/broken.png"]}, "image 0: cannot decode the image"),
        ({"images": ["img/red.png", "img/red.png"]}, "1 image placeholder(s) <|image_pad|> for 2"),
        ({"images": []}, "1 image placeholder(s) <|image_pad|> for 0"),
    ],
)
def test_bad_rows_are_errors_with_the_yaml_path_and_row(tmp_path, row, message):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": PROMPT, "answer": "1", **row}]
    errors = _errors(tmp_path, rows)
    assert len(errors) == 1
    assert errors[0].startswith("data.path: row 2 of ")
    assert message in errors[0]


def test_rows_are_processed_once_into_ids_and_pixels(tmp_path):
    import torch

    from posttrain.backend import load_tokenizer
    from posttrain.config.sections import ModelArgs
    from posttrain.tasks.data import load_prompts
    from posttrain.tasks.presets import preset_path

    tokenizer = load_tokenizer(ModelArgs(model_name_or_path=preset_path("preset:tiny-qwen2-vl")))
    rows = [
        {"prompt": PROMPT, "answer": "1", "images": ["img/red.png"]},
        {"prompt": "1+2=", "answer": "3"},
    ]
    prompts = load_prompts(DataConfig(path=_write(tmp_path, rows)), str(tmp_path), tokenizer)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    # 32x32 pixels, 8-pixel patches merged 2x2: 16 patches, 4 image tokens.
    assert prompts[0].ids.count(image_id) == 4
    assert prompts[0].images.pixel_values.shape == (16, 384)
    assert torch.equal(prompts[0].images.image_grid_thw, torch.tensor([[1, 4, 4]]))
    assert prompts[1].images is None

    synthetic = load_prompts(
        DataConfig(synthetic=SyntheticData(task="count_shapes")), str(tmp_path), tokenizer
    )
    assert len(synthetic) == 81  # every layout of 4 cells, each empty, red or blue
    assert sorted({p.answer for p in synthetic}) == ["0", "1", "2", "3", "4"]
    assert len({p.images.pixel_values.numpy().tobytes() for p in synthetic}) == 81


def test_parquet_rows_with_image_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": PROMPT, "answer": "1", "images": [_png()]},
        {"prompt": PROMPT, "answer": "1", "images": [b"not an image"]},
    ]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = ErrorReport()
    check_prompt_source(DataConfig(path=str(path)), str(tmp_path), "data", report)
    [issue] = report.errors
    assert issue.path == "data.path"
    assert issue.message.startswith("row 2 of ") and "cannot decode the image" in issue.message


def test_the_chat_template_wraps_prompts_with_images_too(tmp_path):
    """A tokenizer with a chat template renders a prompt with images through it, placeholders
    included, before the processor expands them; data.apply_chat_template: never does not."""
    from posttrain.backend import load_tokenizer
    from posttrain.config.sections import ModelArgs
    from posttrain.tasks.data import load_prompts
    from posttrain.tasks.presets import preset_path

    tokenizer = load_tokenizer(ModelArgs(model_name_or_path=preset_path("preset:tiny-qwen2-vl")))
    # A template in the tiny alphabet: the user's turn, then "=" as the generation prompt.
    tokenizer.chat_template = (
        "{% for m in messages %}1+{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    rows = [{"prompt": PROMPT, "answer": "1", "images": ["img/red.png"]}]
    path = _write(tmp_path, rows)
    templated = load_prompts(DataConfig(path=path), str(tmp_path), tokenizer)[0]
    plain = load_prompts(
        DataConfig(path=path, apply_chat_template="never"), str(tmp_path), tokenizer
    )[0]
    expanded = PROMPT.replace(IMAGE_PAD, IMAGE_PAD * 4)
    assert list(templated.ids) == tokenizer(f"1+{expanded}=", add_special_tokens=False)["input_ids"]
    assert list(plain.ids) == tokenizer(expanded, add_special_tokens=True)["input_ids"]
    assert templated.images.pixel_values.shape == plain.images.pixel_values.shape == (16, 384)
