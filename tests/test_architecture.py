"""The package's shape: imports only run down the layer order, and no text in the package narrates its history.

The layer order is written here once (``LAYERS``) and explained in ``docs/architecture.md``. A package may import
itself and any package of a lower layer, never one of its own layer or above. Every import counts, at module level
or inside a function (a lazy import is still a dependency); only imports under ``if TYPE_CHECKING:`` are skipped,
since they exist for annotations and never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "linmem"

# Lowest first. ``linmem`` is the package's own ``__init__`` (the public face: it imports models and ops).
LAYERS: list[set[str]] = [
    {"io"},
    {"ops"},
    {"data"},
    {"layers"},
    {"models"},
    {"memory", "integrations"},
    {"eval"},
    {"train"},
    {"zoo", "study"},
    {"bench", "demo"},
    {"cli", "linmem"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The layer unit of a ``linmem`` module: ``linmem.eval.niah`` -> ``eval``, ``linmem.cli`` -> ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "linmem"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST, module: str, is_package: bool):
    """``(line, imported module)`` of every ``linmem`` import in ``tree`` outside ``if TYPE_CHECKING:`` blocks
    (relative imports resolved against ``module``; ``from linmem import x`` yields ``linmem.x``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names if alias.name.startswith("linmem"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base == "linmem":
                yield from ((node.lineno, f"linmem.{alias.name}") for alias in node.names)
            elif base.startswith("linmem."):
                yield node.lineno, base


MODULE_NAME = re.compile(r"linmem(?:\.[A-Za-z_][A-Za-z_0-9]*)+")


def string_imports(tree: ast.AST):
    """``(line, module)`` of every string constant that is a whole ``linmem`` module name: what a lazy table or an
    ``importlib.import_module`` call imports by name, a dependency all the same."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            yield node.lineno, node.value


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer():
    units = {package_of(module_name(p)) for p in modules()}
    assert units <= set(RANK), f"packages without a place in LAYERS: {sorted(units - set(RANK))}"


def test_imports_run_down_the_layers():
    broken = []
    for path in modules():
        module = module_name(path)
        own = package_of(module)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found = [*runtime_imports(tree, module, path.name == "__init__.py"), *string_imports(tree)]
        for line, target in found:
            other = package_of(target)
            if other == own or other not in RANK:
                continue
            if RANK[other] >= RANK[own]:
                where = "the same layer as" if RANK[other] == RANK[own] else "a layer above"
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target}: {other} is in {where} {own}")
    assert not broken, "imports against the layer order (see docs/architecture.md):\n" + "\n".join(broken)


def test_the_rule_catches_an_upward_import():
    """The check itself: an upward import inside a function is found, one under TYPE_CHECKING is not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from linmem.train import trainer\n"
              "def f():\n    from linmem.eval.loading import load_model\n")
    found = list(runtime_imports(ast.parse(source), "linmem.data.build", False))
    assert found == [(5, "linmem.eval.loading")]
    assert list(runtime_imports(ast.parse("from ..io import atomic\n"), "linmem.data.build", False)) == [
        (1, "linmem.io")]
    by_name = 'PROVIDERS = {"niah": "linmem.eval.niah"}\nimportlib.import_module("linmem.memory.kv_filler")\n'
    assert sorted(string_imports(ast.parse(by_name))) == [(1, "linmem.eval.niah"), (2, "linmem.memory.kv_filler")]
    assert list(string_imports(ast.parse('text = "see linmem.eval.niah for more"\n'))) == []


# ---------------------------------------------------------------- history in the text

# A session, a numbered or ordinal run / sweep / probe, or a calendar date: the text of the package says what the code
# does and why, never when or in which run something was measured (git history and docs/changelog.md keep that).
ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))"
HISTORY = re.compile(
    rf"\bsessions?\s*#?\d+\b|\b{ORDINAL}\b(?:[ \-]+[\w]+){{0,2}}?[ \-]+"
    r"(?:run|sweep|session|probe)(?!s\b)\b|\b(?:run|sweep|probe)\s*#\d+|\b(?:run|sweep|probe) \d+\b(?! \w)"
    r"|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)


def history_texts() -> list[Path]:
    generated = [ROOT / "docs" / "zoo.md", *sorted((PACKAGE / "zoo" / "models").glob("*/README.md"))]
    return modules() + [p for p in generated if p.is_file()]


def test_pattern_finds_history():
    for text in ("until session 8", "the seventh run", "run 7", "third GPU run", "fourth run's sweep",
                 "measured on 2026-11-29", "the 7th sweep"):
        assert HISTORY.search(text), text
    for text in ("runs the residual memory", "a third call runs it", "one run does five things", "2,048 tokens",
                 "one GPU session answers both", "run 2 steps"):
        assert not HISTORY.search(text), text


def test_no_history_in_the_text():
    hits = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}" for path in history_texts()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for match in HISTORY.finditer(line)]
    assert not hits, "history in the text (say what and why, not when):\n" + "\n".join(hits)
