"""Print one line per zoo run folder: steps done, last loss, validation loss and recall, mean tokens/s.

    python scripts/zoo/summary.py OUT_ROOT
"""

import json
import statistics
import sys
from pathlib import Path

root = Path(sys.argv[1])
print(f"{'run':18} {'steps':>6} {'loss':>7} {'val_loss':>8} {'recall':>7} {'tok/s':>9} done")
for folder in sorted(p for p in root.iterdir() if p.is_dir()):
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (folder / "metrics.jsonl").is_file() else []
    if not lines:
        print(f"{folder.name:18} no metrics yet")
        continue
    evals = [x for x in lines if "val_loss" in x]
    last_eval = evals[-1] if evals else {}
    speed = statistics.median(x["tokens_per_s"] for x in lines[1:] or lines)
    val, recall = (last_eval.get(k, float("nan")) for k in ("val_loss", "val_recall_acc"))
    print(f"{folder.name:18} {lines[-1]['step']:>6} {lines[-1]['loss']:>7.3f} {val:>8.3f} {recall:>7.3f} "
          f"{speed:>9.0f} {(folder / 'model').is_dir()}")
