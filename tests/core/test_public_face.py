"""The two public faces, ``posttrain`` (workflow and plugin authors) and ``posttrain.backend``
(backend authors): cheap to import, every name resolves, type checkers see the same names, no
name is on both, and the plugin guide documents each name under its face."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain
import posttrain.backend

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "plugin-guide.md"
FACES = {"posttrain": posttrain, "posttrain.backend": posttrain.backend}


def test_importing_the_faces_imports_no_torch():
    code = "import sys, posttrain, posttrain.backend\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False", out.stdout + out.stderr


@pytest.mark.parametrize("face", FACES)
def test_every_public_name_resolves(face):
    module = FACES[face]
    for name in module.__all__:
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize("face", FACES)
def test_type_checkers_see_the_same_names(face):
    module = FACES[face]
    tree = ast.parse(Path(module.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    typed = {alias.asname or alias.name for node in block.body for alias in node.names}
    assert typed == set(module._PUBLIC)


def test_no_name_is_on_both_faces():
    assert not set(posttrain.__all__) & set(posttrain.backend.__all__)


@pytest.mark.parametrize("face", FACES)
def test_the_plugin_guide_documents_every_name_under_its_face(face):
    section = GUIDE.read_text().split("## The public face", 1)[1].split("\n## ", 1)[0]
    own = section.split(f"### `{face}`", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", own))
    missing = sorted(set(FACES[face].__all__) - documented)
    assert not missing, f"docs/plugin-guide.md's section on `{face}` lacks: {missing}"
