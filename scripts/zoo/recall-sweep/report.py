"""Per run of a sweep folder: the training recall loss averaged over each 100 updates, and the held-out recall
accuracy at every evaluation.

    python scripts/zoo/recall-sweep/report.py OUT_DIR
"""

import json
import statistics
import sys
from pathlib import Path

for metrics in sorted(Path(sys.argv[1]).glob("*/metrics.jsonl")):
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        continue
    losses = [r["recall_loss"] for r in rows if r.get("recall_loss") is not None]
    means = [statistics.mean(losses[i:i + 100]) for i in range(0, len(losses), 100)]
    accuracy = [round(r["val_recall_acc"], 3) for r in rows if "val_recall_acc" in r]
    print(f"{metrics.parent.name:24} step {rows[-1]['step']:5} recall loss per 100 updates "
          + " ".join(f"{m:.2f}" for m in means))
    print(f"{'':24} held-out recall accuracy {accuracy}")
