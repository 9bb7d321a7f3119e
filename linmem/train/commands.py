"""``linmem train CONFIG.yaml --out DIR [--max-steps N] [--resume] [--overwrite]``: a thin wrapper around ``train``.

Several processes: ``torchrun --nproc_per_node N -m linmem.cli train CONFIG.yaml --out DIR``.

Only argparse and the standard library load with this module; ``run`` imports the trainer, so that the help and
argument errors answer at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="training config (YAML: model, data, optim, train)")
    parser.add_argument("--out", required=True, type=Path, help="run folder: metrics.jsonl, checkpoints/, model/")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this update (the schedule still follows train.steps; --resume continues)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out (a "
                        "finished run is left as it is)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out that linmem train did not make (its other files are kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.batch_size=8 (repeatable)")
    parser.add_argument("--device", default=None, help="override train.device (auto, cpu, cuda)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from linmem.train.config import load_config
    from linmem.train.trainer import train

    config = load_config(args.config, args.set)
    if args.device:
        config.train.device = args.device
    if args.no_progress:
        config.train.progress = False
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1; got {args.max_steps}")
    info = train(config, args.out, args.max_steps, args.resume, where=str(args.config), overwrite=args.overwrite)
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
