"""Packaging beyond pyproject.toml: the wheel also installs ``linmem-lm-eval.pth`` into site-packages.

lm-evaluation-harness 0.4 finds models only in its own registry; the ``.pth`` line adds ``linmem`` to it in a
process started as ``lm_eval`` (see ``linmem.eval.harness``). Editable installs do not carry it.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path("packaging") / "linmem-lm-eval.pth"


class BuildWithLmEvalHook(build_py):
    """``build_py`` that also puts ``packaging/linmem-lm-eval.pth`` at the top of the wheel."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH.name)]


setup(cmdclass={"build_py": BuildWithLmEvalHook})
