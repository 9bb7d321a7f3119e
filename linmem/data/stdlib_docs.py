"""Docstrings of the installed Python standard library, as plain-text documents.

Importing ~300 stdlib modules has side effects (``antigravity`` opens a browser, ``this`` prints, a broken C
extension can crash the interpreter), so the walk runs in a child interpreter (``python -I`` this file) that
prints one JSON line per event on its real stdout while the modules' own prints go to /dev/null. The parent
restarts the child past a module that killed it. This file uses only the standard library so that the child
never imports linmem (or torch).

Documents, in a fixed order (sorted by id):
  ``stdlib:<module>``        the module docstring, then each public class / function defined in the module with
                             its signature and docstring (class members indented under their class);
  ``stdlib-topic:<topic>``   the language-reference topics that ``help()`` shows (``pydoc_data.topics``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence

# Never imported: side effects on import (GUI, browser, prints), the test suite, or Windows/macOS only.
SKIP_MODULES = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "__hello__", "__phello__",
    "ensurepip", "venv", "lib2to3", "pydoc_data", "msilib", "winreg", "winsound", "msvcrt", "nturl2path",
    "_winapi", "readline", "sitecustomize", "usercustomize", "__main__",
})
# Submodule trees skipped: codec tables and test folders are long and repetitive.
SKIP_SUBTREES = ("encodings.", ".test", ".tests", ".idle_test")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
CHILD_TIMEOUT_S = 600.0


def public_top_level_modules() -> list[str]:
    """Sorted public top-level stdlib module names (``sys.stdlib_module_names``) minus ``SKIP_MODULES``."""
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)


def _clean(text: str | None) -> str:
    if not text:
        return ""
    import inspect

    # Reprs of defaults can hold memory addresses, which differ between runs.
    return _ADDRESS.sub("", inspect.cleandoc(text)).strip()


class _Shown:
    """Stands in for a default value in a signature; ``repr`` gives the text to show."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown_default(value: object) -> _Shown:
    """Literal defaults as they are; anything else as ``...``: a default computed at import can hold the
    machine's paths or environment (``cgi``'s ``environ=os.environ``, ``platform``'s ``sys.executable``)."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return _Shown(repr(value))
    if isinstance(value, (str, bytes)) and len(value) <= 40:
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if "/" not in text and "\\" not in text:
            return _Shown(repr(value))
    if isinstance(value, tuple) and len(value) <= 4 and all(not isinstance(v, (tuple, list)) for v in value):
        shown = [_shown_default(v).text for v in value]
        return _Shown(f"({', '.join(shown)}{',' if len(shown) == 1 else ''})")
    return _Shown("...")


def _signature(obj: object) -> str:
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p if p.default is p.empty else p.replace(default=_shown_default(p.default))
              for p in sig.parameters.values()]
    return _ADDRESS.sub("", str(sig.replace(parameters=params)))


def _own_doc(obj: object) -> str:
    """The object's own docstring (not one inherited from a base class, unlike ``inspect.getdoc``)."""
    doc = getattr(obj, "__doc__", None)
    return _clean(doc) if isinstance(doc, str) else ""


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _render_class(name: str, cls: type) -> str:
    parts = [f"class {name}{_signature(cls)}"]
    if doc := _own_doc(cls):
        parts.append(_indent(doc, "    "))
    for attr in sorted(vars(cls)):
        if attr.startswith("_"):
            continue
        member = vars(cls)[attr]
        func = getattr(member, "__func__", member)  # staticmethod / classmethod
        if isinstance(member, property):
            body = f"property {attr}"
        elif callable(func):
            body = f"def {attr}{_signature(func)}"
        else:
            continue
        doc = _own_doc(member if isinstance(member, property) else func)
        parts.append(_indent(body + ("\n" + _indent(doc, "    ") if doc else ""), "    "))
    return "\n\n".join(parts)


def render_module(module: object) -> str:
    """Plain text of a module's docs: its docstring, then its public classes and functions (sorted by name)."""
    name = module.__name__
    parts = [f"Module {name}"]
    if doc := _own_doc(module):
        parts.append(doc)
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if isinstance(obj, type):
            parts.append(_render_class(attr, obj))
        elif callable(obj):
            doc = _own_doc(obj)
            parts.append(f"def {attr}{_signature(obj)}" + ("\n" + _indent(doc, "    ") if doc else ""))
    return "\n\n".join(parts)


def _submodule_names(package: object) -> list[str]:
    import pkgutil

    found = []
    for info in pkgutil.iter_modules(getattr(package, "__path__", []), package.__name__ + "."):
        leaf = info.name.rsplit(".", 1)[1]
        if leaf.startswith("_") or any(s in info.name + "." for s in SKIP_SUBTREES):
            continue
        found.append(info.name)
    return sorted(found)


def _emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def _walk(roots: Sequence[str], skip: set[str], out) -> None:
    """Import each module depth first, emitting ``{"start": name}`` before and ``{"id", "text"}`` after."""
    import importlib
    import warnings

    stack = list(reversed(roots))
    while stack:
        name = stack.pop()
        if name in skip or name.split(".")[0] in SKIP_MODULES:
            continue
        _emit(out, {"start": name})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
                text = render_module(module)
        except BaseException:  # noqa: BLE001 - any failure (even SystemExit) only skips the module
            continue
        _emit(out, {"id": f"stdlib:{name}", "text": text})
        stack.extend(reversed(_submodule_names(module)))


def _topics(out) -> None:
    import pydoc_data.topics

    for topic in sorted(pydoc_data.topics.topics):
        _emit(out, {"id": f"stdlib-topic:{topic}", "text": pydoc_data.topics.topics[topic].strip()})


def _child_main(argv: list[str]) -> None:
    """``python -I stdlib_docs.py ROOTS_JSON SKIP_JSON TOPICS``: records on the real stdout, prints discarded."""
    roots, skip, topics = json.loads(argv[0]), set(json.loads(argv[1])), argv[2] == "1"
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # modules that print at import (or from C) write to /dev/null
    os.dup2(devnull, 2)
    sys.stdin = open(os.devnull)
    if topics:
        _topics(out)
    _walk(roots, skip, out)
    _emit(out, {"done": True})


def _run_child(roots: Sequence[str], skip: set[str], topics: bool) -> tuple[list[dict], bool]:
    cmd = [sys.executable, "-I", os.path.abspath(__file__), json.dumps(list(roots)), json.dumps(sorted(skip)),
           "1" if topics else "0"]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=CHILD_TIMEOUT_S)
        raw = proc.stdout
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or b""
    records = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.startswith("{")]
    return records, bool(records) and records[-1].get("done", False)


def collect(modules: Sequence[str] | None = None, topics: bool = True, max_restarts: int = 20) -> dict[str, str]:
    """Docs of ``modules`` (default: every public top-level stdlib module) and their public submodules.

    Returns ``{source_id: text}`` sorted by id. A module that fails to import is left out; one that kills the
    child interpreter is skipped on restart (at most ``max_restarts`` times).
    """
    roots = list(modules) if modules is not None else public_top_level_modules()
    skip: set[str] = set()
    docs: dict[str, str] = {}
    for _ in range(max_restarts + 1):
        records, finished = _run_child(roots, skip, topics)
        started = [r["start"] for r in records if "start" in r]
        docs.update({r["id"]: r["text"] for r in records if "id" in r})
        if finished:
            break
        if not started:
            raise RuntimeError("the stdlib docs child interpreter died before importing any module")
        skip.add(started[-1])  # the module being imported when the child died; the rest is redone
    return dict(sorted((k, v) for k, v in docs.items() if v.strip()))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
