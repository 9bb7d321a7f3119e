"""Add the ``source`` and the ``document`` of each perplexity window to study records written before
``linmem.study.items`` kept them.

    python scripts/study/label_window_sources.py runs/study/rla-paper [--data data/zoo-4k]

A window's source and document are what ``linmem.data.windows.sequential_window_sources`` and
``sequential_window_documents`` give for the split the run was evaluated on, the functions a new evaluation uses, so
labelled old records and new ones agree: the study's tables then resample the test documents of the old records too
(``linmem.study.tables``), not their windows. The windows are rebuilt from the dataset (the run's ``data.dir`` unless
``--data`` is given) and checked against the record: the same number of windows or fewer (``max_tokens``) and every
window's target count equal to ``seq_len - 1``, and a column the record has already equal to the dataset's (the
sources of a record written before documents: other data, such as other split fractions, would label the windows
with documents they do not hold). A column the record has is left as it is; each changed ``items.json`` is replaced
atomically.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from linmem.data.shards import TokenShards
from linmem.data.windows import sequential_window_documents, sequential_window_sources
from linmem.io.atomic import write_json_atomic

# the columns this script adds, each from the function a new evaluation labels its windows with
LABELS = {"source": sequential_window_sources, "document": sequential_window_documents}


def label(items_path: Path, data: Path | None) -> str:
    record = json.loads(items_path.read_text(encoding="utf-8"))
    ppl = record["records"].get("ppl")
    if not ppl or not ppl["unit"]:
        return "no perplexity items"
    missing = [column for column in LABELS if column not in ppl]
    if not missing:
        return "already labelled"
    config = yaml.safe_load((items_path.parent / "config.yaml").read_text(encoding="utf-8"))
    folder = data or Path(config["data"]["dir"])
    targets = set(ppl["den"])
    if len(targets) != 1:
        raise ValueError(f"{items_path}: windows of different lengths {sorted(targets)}")
    seq_len = int(targets.pop()) + 1
    split = TokenShards(folder).split(record["eval"]["options"]["split"])
    labels = {column: function(split, seq_len) for column, function in LABELS.items()}
    n_windows = len(labels["source"])
    if ppl["unit"] != [f"w{i}" for i in range(len(ppl["unit"]))] or len(ppl["unit"]) > n_windows:
        raise ValueError(f"{items_path}: {len(ppl['unit'])} windows do not match the {n_windows} windows of "
                         f"{seq_len} tokens in {folder}")
    for column in LABELS:  # a column the record has must be the dataset's: else the data are not the run's
        if column not in missing and ppl[column] != labels[column][:len(ppl["unit"])]:
            raise ValueError(f"{items_path}: its windows' {column}s differ from those of {folder}: not the data the "
                             "run was evaluated on")
    for column in missing:
        ppl[column] = labels[column][:len(ppl["unit"])]
    write_json_atomic(items_path, record)
    counts = {s: ppl["source"].count(s) for s in dict.fromkeys(ppl["source"])}
    return (f"labelled {' and '.join(missing)}: " + ", ".join(f"{s} {n}" for s, n in counts.items())
            + f"; {len(set(ppl['document']))} documents")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study_out", type=Path, help="a study's output folder (runs/MODEL/seed-S/items.json)")
    parser.add_argument("--data", type=Path, help="the dataset folder (default: each run's data.dir)")
    args = parser.parse_args()
    paths = sorted(args.study_out.glob("runs/*/seed-*/items.json"))
    if not paths:
        raise SystemExit(f"no runs/*/seed-*/items.json under {args.study_out}")
    for path in paths:
        print(f"{path.parent.relative_to(args.study_out)}: {label(path, args.data)}")


if __name__ == "__main__":
    main()
