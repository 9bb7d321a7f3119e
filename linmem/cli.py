"""``linmem <command>``: a thin front door; each command lives in its own module and calls library functions.

A command is one entry in ``COMMANDS``: its name, the module that implements it, and a one-line help. The module
defines ``register(parser: argparse.ArgumentParser) -> None``, which adds the command's arguments (or its own
subcommands) and sets ``func``, a function ``(args) -> int | None`` that runs it. Only the module of the command
being run is imported, so ``linmem --help`` stays fast and one command's dependencies never burden another; and a
command module imports only argparse, the standard library and light modules at its top (choices such as the task
names come from small modules like ``linmem.eval.task_names``), its ``func`` imports the rest, so that
``linmem CMD --help`` and a usage error answer without torch or transformers.

Expected failures print as one line on stderr instead of a traceback: a user error (``ValueError``, which
includes a damaged file's ``DamagedFileError``) or a missing file (``FileNotFoundError``) exits with 2, any other
operating-system error (``OSError``: a full disk, a read-only folder) with 1, Ctrl-C (``KeyboardInterrupt``) with
130. ``linmem --debug COMMAND`` (or ``LINMEM_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from linmem import __version__

# name -> (module with register(parser), one-line help). Add a command with one line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("linmem.data.commands", "build and inspect corpora, tokenizers and token shards"),
    "train": ("linmem.train.commands", "train a model from a YAML config (one process or torchrun)"),
    "eval": ("linmem.eval.commands", "evaluate a model folder: perplexity, cloze, MQAR, NIAH, stability, recall"),
    "probe": ("linmem.memory.commands", "memory lab: how a model writes, keeps and reads a fact (report.html)"),
    "zoo": ("linmem.zoo.commands", "the shipped model zoo: list it, or evaluate and package trained runs"),
    "study": ("linmem.study.commands", "train and evaluate models under one recipe, 3+ seeds each: tables with CIs"),
    "demo": ("linmem.demo", "evaluate the shipped models and probe one of them on this CPU (report.html)"),
    "export": ("linmem.train.export", "a training checkpoint (full or FSDP2-sharded) as a from_pretrained folder"),
    "params": ("linmem.train.params", "parameter count of a training config's model (meta device, no memory)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``linmem`` parser; only ``command``'s module is imported to fill in its arguments."""
    parser = argparse.ArgumentParser(prog="linmem", description="The memory of linear-attention language models.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also LINMEM_DEBUG=1)")
    parser.add_argument("--version", action="version", version=f"linmem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).register(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.parse_args([args.command, "--help"])
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a pipe's reader that has gone shows here, inside the handlers below
        return code
    except BrokenPipeError:  # the reader of stdout left (``linmem zoo list | head``): stop quietly, like a shell tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout would otherwise fail again
        return 141  # 128 + SIGPIPE
    except (ValueError, OSError, KeyboardInterrupt) as e:
        if args.debug or os.environ.get("LINMEM_DEBUG"):
            raise
        print(f"linmem {args.command}: {error_line(e)}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 2 if isinstance(e, (ValueError, FileNotFoundError)) else 1


def error_line(error: BaseException) -> str:
    """``error`` as one line: its kind and message (an ``OSError`` with the file it concerns)."""
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted{f' ({error})' if str(error) else ''}"
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        text = f"{error.strerror}{where}"
    else:
        text = str(error) or type(error).__name__
    return "error: " + " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
