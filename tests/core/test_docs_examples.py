"""Every fenced block of README.md and docs/*.md runs, or says why it does not.

The convention: a block that must not run here (it installs packages, needs a GPU or a cluster,
trains for minutes, or is pseudo-code, a diagram or sample output) has the line

    <!-- no-run: REASON -->

right above its opening fence (GitHub does not render it). Every other block runs, by its
language, and a block of any other language fails, so that a new example cannot go untested:

* ``yaml``: a block with an ``actor_train`` section is a whole workflow; any other block is a
  fragment, merged into examples/quickstart.yaml. Either is validated as ``posttrain validate``
  does, relative paths resolved from the repository root.
* ``python``: the blocks of one file run in order in one namespace (a block may use what an
  earlier one defined). The hook implementations a block defines are registered against the
  hook specifications (an unknown hook or argument fails) and its declaration hooks
  (``posttrain_add_*``, ``posttrain_environment_checks``) are called.
* ``toml``: parsed; its entry points must be in the ``posttrain`` group.
* ``bash``: each line is ``posttrain validate | plan | plugins | doctor ...``, run in process
  from the repository root; each must exit 0.

A no-run bash block still has the paths it names checked (``examples/quickstart.yaml``,
``./plugins/fsdp``). The prose is checked too, where it names something the code defines:
presets, hooks, ``posttrain`` subcommands, ``section.key`` config paths (with their values),
files, links and ``posttrain.`` modules. The docs are checked with the example plugin
(examples/third_party_plugin) loaded, since the guide uses its names.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import sys
import tomllib
import types
import typing
from pathlib import Path

import attrs
import pluggy
import pytest
import yaml

import posttrain
import posttrain.backend
from posttrain import hookspecs
from posttrain.config.report import ErrorReport
from posttrain.config.sections import RoleConfig, Workflow
from posttrain.config.yaml_loader import load_yaml_text
from posttrain.host.plugin_host import ENTRY_POINT_GROUP, create_plugin_host
from posttrain.host.strategy import StrategySpec
from posttrain.loading.workflow import build_workflow
from posttrain.tasks.presets import PRESETS

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
EXAMPLE_PLUGIN_SRC = REPO / "examples" / "third_party_plugin" / "src"
FACE = REPO / "core" / "posttrain" / "__init__.py"
FACES = {FACE: posttrain, REPO / "core" / "posttrain" / "backend.py": posttrain.backend}

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
NO_RUN = re.compile(r"^\s*<!-- no-run: (?P<reason>\S.*?) -->\s*$")
RUNNABLE_COMMANDS = ("validate", "plan", "plugins", "doctor")
DECLARATION_HOOKS = (
    "posttrain_add_strategies",
    "posttrain_add_reward_functions",
    "posttrain_add_weight_transports",
    "posttrain_add_advantage_estimators",
    "posttrain_add_policy_losses",
    "posttrain_add_algorithms",
    "posttrain_environment_checks",
)
# The repository's own top-level folders: a path in the prose that starts with one must exist
# (`runs/quickstart/` or `RUN_DIR/logs/` are made by a run).
TOP_LEVEL = ("core", "plugins", "examples", "docs", "tests", "benchmarks", ".ci")
SECTIONS = [f.name for f in attrs.fields(Workflow) if f.name != "base_dir"]


@attrs.frozen
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    no_run: str | None  # the reason, when marked

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line} ({self.lang or 'no language'})"


def fenced_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks, number = [], 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body, end = [], number + 1
        while end < len(lines) and not re.fullmatch(
            rf" *{fence[0]}{{{len(fence)},}} *", lines[end]
        ):
            body.append(lines[end][indent:] if lines[end][:indent].isspace() else lines[end])
            end += 1
        marker = NO_RUN.match(lines[number - 1]) if number else None
        blocks.append(
            Block(
                doc=doc,
                line=number + 1,
                lang=(opening["info"].split() or [""])[0].lower(),
                text="\n".join(body) + "\n",
                no_run=marker["reason"] if marker else None,
            )
        )
        number = end + 1
    return blocks


def inline_spans(doc: Path) -> list[str]:
    """The text of every `code span` outside fenced blocks."""
    text = doc.read_text(encoding="utf-8")
    prose = re.sub(r"^ *(`{3,}|~{3,}).*?^ *\1 *$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"`([^`\n]+)`", prose)


@pytest.fixture(scope="module")
def host():
    """The CLI's plugin host, plus the example plugin's two entry points (the guide's examples
    name them: its reward, environment and logger, and the trainer ddp_train)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLE_PLUGIN_SRC))
        from posttrain_example_plugin import ddp_plugin
        from posttrain_example_plugin import plugin as example

        yield create_plugin_host(extra_plugins=[example, ddp_plugin.plugin])
    for name in [m for m in sys.modules if m.startswith("posttrain_example_plugin")]:
        del sys.modules[name]


def validation_errors(raw, host, overrides=None) -> list[str]:
    if isinstance(raw, dict) and "actor_train" not in raw:  # a fragment: merge into a workflow
        raw = merged(yaml.safe_load(QUICKSTART.read_text(encoding="utf-8")), raw)
    _, report = build_workflow(raw, host, ErrorReport(), base_dir=str(REPO), overrides=overrides)
    return [issue.render() for issue in report.errors]


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        both_maps = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both_maps else value
    return out


# -- running the blocks ------------------------------------------------------------------------


def run_yaml(block: Block, host, namespace: dict) -> list[str]:
    report = ErrorReport()
    raw = load_yaml_text(block.text, str(block), report)
    return [i.render() for i in report.errors] or validation_errors(raw, host)


def run_python(block: Block, host, namespace: dict) -> list[str]:
    before = dict(namespace)
    exec(compile(block.text, str(block), "exec"), namespace)
    defined = {k: v for k, v in namespace.items() if k not in before or before[k] is not v}
    pm = pluggy.PluginManager("posttrain")
    pm.add_hookspecs(hookspecs)
    module = types.ModuleType(f"docs_block_{block.line}")
    module.__dict__.update(defined)
    pm.register(module)  # checks each implementation's arguments against its specification
    for value in defined.values():
        if not isinstance(value, type) and any(n.startswith("posttrain_") for n in dir(value)):
            pm.register(value)  # a plugin object, e.g. an EngineHooks instance
    pm.check_pending()  # an implementation of no known hook
    for name in DECLARATION_HOOKS:
        answers = getattr(pm.hook, name)()
        if name == "posttrain_add_strategies":
            for spec in (s for answer in answers for s in answer):
                assert isinstance(spec, StrategySpec), spec
                assert attrs.has(spec.config_class), spec
    parser = argparse.ArgumentParser(prog="posttrain")
    pm.hook.posttrain_add_cli_commands(subparsers=parser.add_subparsers())
    return []


def run_toml(block: Block, host, namespace: dict) -> list[str]:
    entry_points = tomllib.loads(block.text).get("project", {}).get("entry-points", {})
    return [
        f"entry-point group '{g}' is not '{ENTRY_POINT_GROUP}'"
        for g in entry_points
        if g != ENTRY_POINT_GROUP
    ]


def cli(args: list[str]) -> str:
    """Run ``posttrain ARGS`` in process; its output when it fails, else ""."""
    from posttrain.cli import main

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        rc = main(args)
    return f"exit {rc}: {output.getvalue().strip()[-2000:]}" if rc else ""


def run_bash(block: Block, host, namespace: dict) -> list[str]:
    problems = []
    for words in commands(block):
        if len(words) < 2 or words[0] != "posttrain" or words[1] not in RUNNABLE_COMMANDS:
            runnable = " | ".join(RUNNABLE_COMMANDS)
            return [f"cannot run `{shlex.join(words)}` (only posttrain {runnable}); mark it no-run"]
        failure = cli(words[1:])
        if failure:
            problems.append(f"`{shlex.join(words)}`: {failure}")
    return problems


RUNNERS = {"yaml": run_yaml, "python": run_python, "toml": run_toml, "bash": run_bash}


def check_no_run_bash(block: Block) -> list[str]:
    """The paths it names exist, and the workflow of a `posttrain run` validates (with its
    --set overrides): validating is cheap where running is not."""
    problems = [f"names {p}, which does not exist" for p in named_paths(block)]
    for words in commands(block):
        is_run = len(words) > 2 and words[0].endswith("posttrain") and words[1] == "run"
        failure = cli(["validate", *words[2:]]) if is_run else ""
        if failure:
            problems.append(f"`{shlex.join(words)}`: validating its workflow: {failure}")
    return problems


def commands(block: Block) -> list[list[str]]:
    """The words of each command of a shell block (lines, then `&&`), comments left out."""
    out = []
    for line in block.text.splitlines():
        words = shlex.split(line, comments=True)
        while "&&" in words:
            cut = words.index("&&")
            out.append(words[:cut])
            words = words[cut + 1 :]
        out += [words] if words else []
    return out


def named_paths(block: Block) -> list[str]:
    """Repository paths a shell block names (`./x`, `a/b`, `x.yaml`) that do not exist; the
    virtual environments (`.venv-*`) its commands create and the run directories (`runs/...`)
    its runs write are left out."""
    missing = []
    for word in (w for words in commands(block) for w in words):
        word = re.sub(r"\[[^\]]*\]$", "", word)  # "./core[test]": an install's extras
        looks_like_path = "/" in word or re.search(r"\.(ya?ml|py|sh|toml|json)$", word)
        skipped = word.startswith(("-", ".venv", "http", "runs/")) or "=" in word
        if looks_like_path and not skipped and not (REPO / word).exists():
            missing.append(word)
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_block_runs_or_says_why_not(doc, host, monkeypatch):
    monkeypatch.chdir(REPO)
    namespace: dict = {"__name__": f"docs_example_{doc.stem.replace('-', '_')}"}
    blocks = fenced_blocks(doc)
    lines = doc.read_text(encoding="utf-8").splitlines()
    markers = sum(bool(NO_RUN.match(line)) for line in lines)
    problems = []
    if markers != sum(b.no_run is not None for b in blocks):
        problems.append("a <!-- no-run: REASON --> marker is not on the line right above a fence")
    for block in blocks:
        if block.no_run is not None:
            if block.lang == "bash":
                problems += [f"{block}: {p}" for p in check_no_run_bash(block)]
            continue
        runner = RUNNERS.get(block.lang)
        if runner is None:
            problems.append(f"{block}: no runner for this language; mark it <!-- no-run: why -->")
            continue
        try:
            problems += [f"{block}: {p}" for p in runner(block, host, namespace)]
        except Exception as exc:
            problems.append(f"{block}: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems)


# -- what the prose names -----------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_prose_names_what_exists(doc, host):
    text = doc.read_text(encoding="utf-8")
    spans = inline_spans(doc)
    problems = []
    for preset in re.findall(r"preset:([\w-]*\w)", text):
        if preset not in PRESETS:
            problems.append(f"preset '{preset}' does not exist (presets: {', '.join(PRESETS)})")
    problems += [f"`{n}` is not a hook" for n in hook_like_names(text) if not hasattr(hookspecs, n)]
    known = subcommands(host)
    shell = [
        shlex.join(words) for b in fenced_blocks(doc) if b.lang == "bash" for words in commands(b)
    ]
    for span in [*spans, *shell]:
        for command in re.findall(r"(?:^|[\s/])posttrain ([a-z][\w-]*)", span):
            if command not in known:
                problems.append(f"`{span}`: no subcommand '{command}'")
        problems += [f"`{span}`: {p}" for p in config_problems(span, host)]
        problems += [f"`{span}`: {p}" for p in path_problems(span)]
        problems += [f"`{span}`: {p}" for p in module_problems(span)]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (doc.parent / target).exists():
            problems.append(f"link to {target}, which does not exist")
    assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


def hook_like_names(text: str) -> set[str]:
    """The `posttrain_*` names used as hook names: not a package (`posttrain_fsdp`), a module
    path (`posttrain_mybackend.engine`, `posttrain_megatron/...`), a package glob
    (`posttrain_mybackend*`) or an import."""
    packages = {p.name for p in REPO.glob("plugins/*/posttrain_*")} | {
        p.name for p in EXAMPLE_PLUGIN_SRC.glob("posttrain_*")
    }
    names = set()
    for match in re.finditer(r"\bposttrain_[a-z0-9_]*[a-z0-9]\b(?![./:*])", text):
        before = text[max(0, match.start() - 5) : match.start()]
        if match[0] not in packages and not before.endswith(("from ", "import ")):
            names.add(match[0])
    return names


def subcommands(host) -> set[str]:
    from posttrain.cli import build_parser

    parser = build_parser(host)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def config_problems(span: str, host) -> list[str]:
    """`trainer.save_steps` names a key; `cluster.colocation: separate` (or `=`) a valid value;
    `cluster: {launcher: ray}` is a fragment that must validate."""
    sections = "|".join([*SECTIONS, "<role>"])
    fragment = re.fullmatch(rf"({sections}): \{{.*\}}", span)
    if fragment:
        return validation_errors(yaml.safe_load(span), host)
    keyed = re.fullmatch(rf"((?:{sections})(?:\.\w+)+)(?:(?:: |=)(.+))?", span)
    if not keyed:
        return []
    path, value = keyed.groups()
    problem = unknown_key(path)
    if problem or value is None or path.startswith("<role>"):
        return [problem] if problem else []
    return validation_errors({}, host, overrides={path: yaml.safe_load(value)})


def unknown_key(path: str) -> str:
    cls: typing.Any = Workflow
    for key in path.split("."):
        if key == "<role>":
            cls = RoleConfig
            continue
        hints = typing.get_type_hints(cls) if attrs.has(cls) else {}
        if key not in hints:
            return f"'{key}' is not a key of {cls.__name__}"
        cls = next((t for t in typing.get_args(hints[key]) if attrs.has(t)), hints[key])
        if not attrs.has(cls):  # a leaf, or strategy_config (the strategy's own class)
            return ""
    return ""


def path_problems(span: str) -> list[str]:
    """Repository paths (`examples/quickstart.yaml`) and source files (`posttrain/hookspecs.py`,
    from core/, core/posttrain/ or a plugin's folder) must exist."""
    if not re.fullmatch(r"[\w.-]+(/[\w.+-]*)+", span):
        return []
    roots = [REPO, REPO / "core", REPO / "core" / "posttrain", *REPO.glob("plugins/*")]
    checked = span.endswith(".py") or span.split("/")[0] in TOP_LEVEL
    if checked and not any((root / span).exists() for root in roots):
        return [f"{span} does not exist"]
    return []


def module_problems(span: str) -> list[str]:
    """`posttrain.a.b.Name`: module a.b exists in core/ and defines (or imports) Name."""
    problems = []
    for dotted in re.findall(r"(?<![\w.])posttrain(?:\.\w+)+", span):
        parts, where = dotted.split(".")[1:], REPO / "core" / "posttrain"
        while parts and ((where / parts[0]).is_dir() or (where / f"{parts[0]}.py").exists()):
            where = where / parts.pop(0)
        source = where / "__init__.py" if where.is_dir() else where.with_suffix(".py")
        # The public faces define their names lazily: they are their __all__.
        names = FACES[source].__all__ if source in FACES else top_level_names(source)
        if parts and parts[0] not in names:
            problems.append(f"{source.relative_to(REPO)} does not define {parts[0]}")
    return problems


def top_level_names(source: Path) -> set[str]:
    names = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if "__getattr__" in names and "__all__" in names:  # names made lazily: those it exports
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names |= set(ast.literal_eval(node.value))
    return names


def test_block_parser(tmp_path):
    """Markers, indented fences (in a list item) and languages, as the tests above read them."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "* item:\n\n  <!-- no-run: a sample -->\n  ```yaml\n  a: 1\n\n  b: 2\n  ```\n"
        "````\n```\nnested\n```\n````\n"
    )
    assert fenced_blocks(doc) == [
        Block(doc=doc, line=4, lang="yaml", text="a: 1\n\nb: 2\n", no_run="a sample"),
        Block(doc=doc, line=9, lang="", text="```\nnested\n```\n", no_run=None),
    ]
