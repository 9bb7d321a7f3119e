"""``linmem train CONFIG.yaml --out DIR [--max-steps N] [--resume [--accept-changed-data]] [--overwrite]
[--backend NAME]``: a thin wrapper around ``train``.

Several processes: ``torchrun --nproc_per_node N -m linmem.cli train CONFIG.yaml --out DIR``.

Only argparse, the standard library and ``linmem.io.backend_names`` load with this module; ``run`` checks the
paths and arguments first (``check_arguments``) and imports the trainer after, so that the help and these errors
answer at once, before torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from linmem.io.backend_names import add_backend_option


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="training config (YAML: model, data, optim, train)")
    parser.add_argument("--out", required=True, type=Path, help="run folder: metrics.jsonl, checkpoints/, model/")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this update (the schedule still follows train.steps; --resume continues)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out (a "
                        "finished run is left as it is)")
    parser.add_argument("--accept-changed-data", action="store_true",
                        help="let --resume continue on a dataset whose content changed since the run started")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out that linmem train did not make (its other files are kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.batch_size=8 (repeatable)")
    parser.add_argument("--device", default=None, help="override train.device (auto, cpu, cuda)")
    add_backend_option(parser, default=None, extra_help="; overrides train.backend (auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def check_arguments(args: argparse.Namespace) -> None:
    """The errors that need no config parsing: a missing config file, an ``--out`` that cannot be a run folder,
    ``--resume`` of nothing, ``--max-steps`` below 1."""
    if not args.config.is_file():
        what = "is a folder, not a config file" if args.config.is_dir() else "no such config file"
        raise FileNotFoundError(f"{args.config}: {what}")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a file, not a folder; choose another output folder")
    if args.resume and not args.out.is_dir():
        raise FileNotFoundError(f"--resume: {args.out} does not exist; drop --resume to start a new run there")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1; got {args.max_steps}")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from linmem.train.config import load_config
    from linmem.train.trainer import train

    config = load_config(args.config, args.set)
    if args.device:
        config.train.device = args.device
    if args.backend:
        config.train.backend = args.backend
    if args.no_progress:
        config.train.progress = False
    info = train(config, args.out, args.max_steps, args.resume, where=str(args.config), overwrite=args.overwrite,
                 accept_changed_data=args.accept_changed_data)
    if info.get("interrupted"):
        print(f"stopped after step {info['steps']}: checkpoint in {Path(args.out) / 'checkpoints'}; add --resume "
              "to continue")
        return 130
    if info:
        metrics = info["final_metrics"]
        val = f", val loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
        print(f"trained {info['steps']} steps, {info['tokens']:,} tokens, {info['parameters']:,} parameters in "
              f"{info['train_seconds']:.1f} s: loss {metrics.get('loss', float('nan')):.4f}{val}; model in "
              f"{Path(args.out) / 'model'}")
    return 0
