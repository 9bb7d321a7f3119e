"""Two recall formats under one measurement, per run: the study's own test format (its evaluation,
``runs/MODEL/seed-S/eval/results.json``) beside the second format that ``device_analyses.sh`` evaluated with the same
settings, and the value prior of each (``prior.json``: how strongly the text alone guesses the value).

    python scripts/study/format_table.py OUT.md --study runs/study/NAME ANALYSES [ANALYSES ...] [--plot FIG.png]

ANALYSES: the ``NAME-MODEL-seed-S-analyses.tar`` files (or the folders they were unpacked into, named the same
without ``.tar``). Writes OUT.md (a table: accuracy over all loads and at each load, with the item-bootstrap 95% CI
that ``linmem eval`` reports) and OUT.json beside it; ``--plot`` draws accuracy by number of facts, one panel per
model, a line per seed and format.
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from pathlib import Path


def read_analyses(path: Path) -> dict[str, bytes]:
    """The files of one analyses tar (or folder), by their path inside it (``recall-T-K-V/results.json`` ...)."""
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with tarfile.open(path) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def recall_summary(results: dict) -> dict:
    """Accuracy over all loads and per load, with CIs, from a ``linmem eval`` results.json."""
    recall = results["tasks"]["recall"]
    m = recall["metrics"]
    return dict(format=f"{m['template']}/{m['keys']}/{m['values']}", chance=m["chance"], n=m["n"],
                accuracy=[m["accuracy"], m["ci_low"], m["ci_high"]],
                by_load={int(row["num_bindings"]): [row["accuracy"], row["ci_low"], row["ci_high"]]
                         for row in recall["table"]})


def run_rows(study: Path, analyses: Path) -> list[dict]:
    """The two formats of one run: the study's test format first, then the analysed one."""
    stem = analyses.name.removesuffix(".tar")
    match = re.fullmatch(re.escape(study.name) + r"-(?P<model>.+)-seed-(?P<seed>\d+)-analyses", stem)
    if not match:
        raise SystemExit(f"{analyses}: not named {study.name}-MODEL-seed-S-analyses[.tar]")
    model, seed = match["model"], int(match["seed"])
    files = read_analyses(analyses)
    own = study / "runs" / model / f"seed-{seed}" / "eval" / "results.json"
    if not own.is_file():
        raise SystemExit(f"{own}: the study's evaluation of {model} seed {seed} is not here")
    second = [name for name in files if re.fullmatch(r"recall-[^/]+/results\.json", name)]
    if len(second) != 1:
        raise SystemExit(f"{analyses}: expected one recall-*/results.json, found {second or 'none'}")
    prior = json.loads(files["prior.json"]) if "prior.json" in files else {}
    rows = []
    own_results = json.loads(own.read_text())
    if "recall" not in own_results["tasks"]:
        raise SystemExit(f"{own}: the study's evaluation has no recall task, so there is no format to compare with")
    for source, results in (("study", own_results), ("analyses", json.loads(files[second[0]]))):
        row = dict(model=model, seed=seed, measured_by=source, **recall_summary(results))
        guess = next((v for k, v in prior.items() if k.endswith(" " + row["format"])), None)
        row["prior"] = None if guess is None else {k: guess[k] for k in ("top2_share", "entropy_fraction")}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    loads = sorted({k for row in rows for k in row["by_load"]})
    ci = lambda v: f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"  # noqa: E731
    head = ["model", "seed", "format", "all loads"] + [f"{k} fact{'s' * (k > 1)}" for k in loads] + \
           ["prior: top-2 share", "prior: entropy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        prior = row["prior"] or {}
        cells = [row["model"], str(row["seed"]), row["format"], ci(row["accuracy"])]
        cells += [ci(row["by_load"][k]) if k in row["by_load"] else "–" for k in loads]
        cells += [f"{prior[k]:.2f}" if k in prior else "–" for k in ("top2_share", "entropy_fraction")]
        lines.append("| " + " | ".join(cells) + " |")
    chance = sorted({row["chance"] for row in rows})
    return "\n".join(lines) + (f"\n\nChance: {', '.join(f'{c:g}' for c in chance)}. Intervals: item bootstrap "
                               "(95%) over the test items of that run. Prior: with no fact in context, the share of "
                               "the two likeliest values and the entropy over the values (fraction of its maximum; "
                               "1 = no preference), averaged over the keys.\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for row in rows))
    formats = list(dict.fromkeys(row["format"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        seeds = sorted({r["seed"] for r in rows if r["model"] == model})
        for row in (r for r in rows if r["model"] == model):
            loads = sorted(row["by_load"])
            acc = [row["by_load"][k] for k in loads]
            color = f"C{formats.index(row['format'])}"
            first_seed = row["seed"] == seeds[0]
            name = row["format"] + (" (the study's test format)" if row["measured_by"] == "study" else "")
            ax.plot(loads, [a[0] for a in acc], "o-", color=color, ms=3, label=name if first_seed else None)
            ax.fill_between(loads, [a[1] for a in acc], [a[2] for a in acc], color=color, alpha=0.12)
        ax.axhline(rows[0]["chance"], color="gray", ls="--", lw=1, label="chance")
        title = f"{model} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
        ax.set(xscale="log", title=title, xlabel="facts in context", ylim=(0, 1))
        ax.set_xticks(loads, [str(k) for k in loads])
    axes[0][0].set_ylabel("clean recall (test items)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Two held-out formats, one measurement: a line per seed, item-bootstrap 95% CI shaded", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the table (Markdown); its JSON goes beside it")
    parser.add_argument("analyses", nargs="+", type=Path)
    parser.add_argument("--study", required=True, type=Path, help="the study folder the runs belong to")
    parser.add_argument("--plot", type=Path, help="a figure of accuracy by number of facts")
    args = parser.parse_args()
    rows = [row for path in sorted(args.analyses) for row in run_rows(args.study, path)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows), encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(rows, args.plot)
    print(args.out.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
