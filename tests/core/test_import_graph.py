"""The import graph of core and the plugins: no circles (imports inside functions and under
``TYPE_CHECKING`` included), and plugins import only core's public face.

Read with ``ast`` (nothing is imported): an edge is any ``import`` statement anywhere in a module,
to the module it names (``from pkg import sub`` is an edge to ``pkg.sub`` when ``sub`` is a
module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Package roots: the folder holding each top-level package.
ROOTS = {
    "posttrain": REPO / "core",
    **{p.name: p.parent for p in REPO.glob("plugins/*/posttrain_*") if p.is_dir()},
    "posttrain_example_plugin": REPO / "examples" / "third_party_plugin" / "src",
}
# What a plugin may import from core: the public face, the hook specifications, the kit.
PUBLIC = ("posttrain", "posttrain.hookspecs", "posttrain.testing")


def modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def _resolve(name: str, current: str, level: int) -> str:
    if level:
        base = current.split(".")
        # A package's own __init__ counts as the package: one level up is its parent.
        is_package = MODULES.get(current, Path()).name == "__init__.py"
        base = base[: len(base) - level + (1 if is_package else 0)]
        return ".".join([*base, name] if name else base)
    return name


def imports_of(name: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import statement of module ``name``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module or "", name, node.level)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.append((sub if sub in MODULES else module, node.lineno))
    return [(target, line) for target, line in out if target.split(".")[0] in ROOTS]


def _cycles() -> list[list[str]]:
    graph = {name: sorted({t for t, _ in imports_of(name) if t in MODULES}) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_import_circles():
    cycles = _cycles()
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", sorted(p for p in ROOTS if p != "posttrain"))
def test_plugins_import_only_the_public_face(package):
    wrong = [
        f"{MODULES[name].relative_to(REPO)}:{line}: {target}"
        for name in MODULES
        if name.split(".")[0] == package
        for target, line in imports_of(name)
        if target.startswith("posttrain.") and not target.startswith(PUBLIC[1:])
    ]
    assert not wrong, "import core internals (use `from posttrain import NAME`):\n" + "\n".join(
        wrong
    )
