"""The op's backend names and the ``--backend`` option of every command that runs a model.

Standard library only, so that a command's ``--help`` and a wrong ``--backend`` answer without torch;
``linmem.ops.backend`` takes ``BACKENDS`` from here.
"""

from __future__ import annotations

import argparse

BACKENDS = ("auto", "reference", "chunk", "triton")

BACKEND_HELP = ("the linear-memory op's backend: auto (Triton's kernels on CUDA where they take the inputs, else "
                "chunk), chunk, reference (the token loop) or triton (an error where its kernels cannot run)")


def add_backend_option(parser: argparse.ArgumentParser, default: str | None = "auto", extra_help: str = "") -> None:
    """``--backend`` with the choices ``BACKENDS``, stored as ``args.backend``."""
    parser.add_argument("--backend", choices=BACKENDS, default=default, help=BACKEND_HELP + extra_help)
