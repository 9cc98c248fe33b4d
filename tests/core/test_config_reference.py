"""docs/config-reference.md is generated from the attrs classes and must never drift from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs

from posttrain.config import data_sections, sections
from posttrain.config_reference import _walk, generate

DOC = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"
REGENERATE = "python -m posttrain.config_reference > docs/config-reference.md"


def test_committed_reference_matches_the_generator():
    assert DOC.read_text(encoding="utf-8") == generate(), f"stale: run `{REGENERATE}`"


def test_module_entry_point_prints_the_reference():
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.config_reference"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == generate()


def test_every_section_and_field_is_documented():
    text = generate()
    classes = [
        obj
        for module in (sections, data_sections)
        for obj in vars(module).values()
        if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == module.__name__
    ]
    assert set(_walk()) | {sections.Workflow} == set(classes)  # every section class is reachable
    for cls in classes:
        heading = "## Workflow (top level)" if cls is sections.Workflow else f"## {cls.__name__}"
        assert heading in text
        for field in attrs.fields(cls):
            if field.name == "base_dir":
                assert "`base_dir`" not in text  # internal, not a YAML key
                continue
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name} is missing"


def test_rows_carry_type_default_and_comment():
    text = generate()
    assert (
        '| `dtype` | one of: `fp32`, `bf16`, `fp16`, `float32`, `bfloat16`, `float16` | `"fp32"` |'
        in text
    )
    assert "| `strategy_name` | string | **required** |" in text
    assert '| `logger` | list of string | `["console", "jsonl"]` |' in text
    assert "`list(range(a, b[, step]))`" in text  # device_mapping's accepted forms
    # Comments above a field and at the end of its line become its description.
    assert "HF directory, hub id, or a tiny preset" in text
    assert "| `rollout_batch_size` | integer, >= 1 | `16` | prompts per step |" in text
    # A field's range (posttrain.config.ranges) follows its type, with meaningful specials.
    assert "| `top_p` | number, in (0, 1] | `1.0` |" in text
    assert "| `save_steps` | integer, >= 1, or 0 (only at the end, when save_final" in text
    assert "YAML path: `model_args`, `<role>.model_args`" in text
