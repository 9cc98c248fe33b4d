"""The CI scripts name only files the repository holds (``.ci/vllm_env.sh`` once pointed at a
note kept outside it)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A relative path with a folder, not one under a shell variable ($venv/...: made by the script).
PATH = re.compile(r"(?<![$\w/.-])(?:\.?[\w-]+/)+[\w.-]+\.(?:md|py|sh|toml|txt|yaml)\b")


def test_every_path_the_ci_scripts_name_exists():
    named = {
        (script.name, path)
        for script in (REPO / ".ci").iterdir()
        for path in PATH.findall(script.read_text(encoding="utf-8"))
    }
    assert ("vllm_env.sh", ".ci/vllm_env.sh") in named  # the pattern finds what it should
    missing = sorted(f"{script}: {path}" for script, path in named if not (REPO / path).exists())
    assert not missing, missing
