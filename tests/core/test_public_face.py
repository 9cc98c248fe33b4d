"""The public face (``import posttrain``): cheap to import, every name resolves, type checkers
see the same names, and the plugin guide documents each one."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import posttrain

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "plugin-guide.md"


def test_importing_the_face_imports_no_torch():
    code = "import sys, posttrain\nprint('torch' in sys.modules, len(posttrain.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False", out.stdout + out.stderr


def test_every_public_name_resolves():
    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None, name


def test_type_checkers_see_the_same_names():
    tree = ast.parse(Path(posttrain.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    typed = {alias.asname or alias.name for node in block.body for alias in node.names}
    assert typed == set(posttrain._PUBLIC)


def test_the_plugin_guide_documents_every_public_name():
    section = GUIDE.read_text().split("## The public face", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", section))
    missing = sorted(set(posttrain.__all__) - documented)
    assert not missing, f"docs/plugin-guide.md's public face section lacks: {missing}"
