"""The import graph of core and the plugins: no circles (imports inside functions and under
``TYPE_CHECKING`` included), core's folders in floors (FLOORS: run-time imports only go down),
and plugins import only core's public face.

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
PUBLIC = ("posttrain", "posttrain.backend", "posttrain.hookspecs", "posttrain.testing")


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


# Core's floors, bottom to top: a folder (or top-level module) imports, at run time, only from
# floors below its own. Imports under ``TYPE_CHECKING`` are exempt: they name types, not code.
FLOORS = [
    # ground: no posttrain import but these
    {"errors", "markers", "paths", "protocol", "version", "hf_progress", "lazy_names"},
    # 1. The hook specifications; each phase's typed settings (config); the checkpoint files.
    {"hookspecs", "config", "checkpoint"},
    # 2. Pieces that need only settings: the plugin host, algorithms, tasks, the sandbox.
    {"algorithms", "host", "sandbox", "tasks"},
    # 3. Backend plumbing (torch, process groups) and the memory plan.
    {"backends", "memory"},
    # 4. What engines and the loop share: log-prob heads, reward scoring, weight-sync sides.
    {"rewards", "scoring", "weight_sync"},
    # 5. Rollouts and environments, micro-batched training.
    {"rollout", "training"},
    # 6. Rank processes and launchers; held-out evaluation.
    {"launch", "evaluation"},
    # 7. The loop; the conformance kit that drives engines as the loop does.
    {"trainer", "testing"},
    # 8. A workflow file loaded and checked against every phase above.
    {"loading"},
    # 9. The CLI's commands, then the CLI and the public face.
    {"commands"},
    {"cli", "config_reference", "__init__", "backend"},
]
FLOOR_OF = {folder: floor for floor, folders in enumerate(FLOORS) for folder in folders}


def _folder(module: str) -> str:
    """``posttrain.a.b`` -> ``a``; ``posttrain`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def runtime_imports_of(name: str) -> list[tuple[str, int]]:
    """:func:`imports_of` less the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    typing_lines = {
        node.lineno
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    return [(target, line) for target, line in imports_of(name) if line not in typing_lines]


CORE = sorted(name for name in MODULES if name.split(".")[0] == "posttrain")


def test_every_core_folder_has_a_floor():
    unplaced = sorted({_folder(name) for name in CORE} - set(FLOOR_OF))
    assert not unplaced, f"place these in FLOORS (tests/core/test_import_graph.py): {unplaced}"


def test_core_folders_import_only_from_floors_below():
    upward = [
        f"{MODULES[name].relative_to(REPO)}:{line}: {_folder(name)} "
        f"(floor {FLOOR_OF[_folder(name)]}) imports {target} "
        f"({_folder(target)}, floor {FLOOR_OF[_folder(target)]})"
        for name in CORE
        for target, line in runtime_imports_of(name)
        if target.startswith("posttrain")
        and _folder(target) != _folder(name)
        and FLOOR_OF.get(_folder(target), 0) >= FLOOR_OF.get(_folder(name), 0)
    ]
    assert not upward, "imports from a floor not below (move the code down, or the import under "
    "TYPE_CHECKING if it names a type):\n" + "\n".join(upward)
