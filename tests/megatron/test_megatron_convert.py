"""``posttrain convert`` (added by the megatron plugin): HF -> dist checkpoint at TP2 -> HF at PP2.

The round trip is bitwise; bad arguments are reported without a traceback.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "convert", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hf_to_megatron_and_back_is_bitwise(tmp_path):
    from megatron_workers import build_hf_model
    from safetensors.torch import load_file

    hf = build_hf_model(str(tmp_path / "hf"), "qwen2")
    to_mcore = _convert("hf-to-megatron", hf, str(tmp_path / "mcore"), "--tp", "2")
    assert to_mcore.returncode == 0, to_mcore.stdout[-2000:] + to_mcore.stderr[-3000:]
    assert (tmp_path / "mcore" / "megatron" / "metadata.json").exists()
    back = _convert(
        "megatron-to-hf",
        str(tmp_path / "mcore"),
        str(tmp_path / "back"),
        "--model",
        hf,
        "--pp",
        "2",
    )
    assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-3000:]
    original = load_file(f"{hf}/model.safetensors")
    converted = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert original.keys() == converted.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name


def test_convert_reports_bad_arguments_without_traceback(tmp_path):
    proc = _convert("megatron-to-hf", str(tmp_path / "missing"), str(tmp_path / "out"), "--tp", "0")
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    for fragment in ("is not a directory", "--model", "--tp: must be at least 1"):
        assert fragment in out, out
