"""The second paper's rows for several models side by side, read from their `linmem probe` records.

    python scripts/probes/probe_table.py LABEL=RESULTS.json[+MORE.json] [LABEL=...] [--out TABLE.md]

One column per model, one row per claim of "How Linear Attention Remembers" that the probe measures (the row
numbers of docs/results.md): the chosen head, write block (and the write block widened past the fact), donor write,
state swap, output patch and restore, head interaction, four-fact edits, the load and gap sweeps and their
paired comparison, key overlap,
write/read Spearman, logit lens, neutral suppression, joint top-k, the corrector, the subspace transfer and, for
RLA/RDN, the split between the base (S) and residual (R) memory. A column may join several records of one model
and task with the same chosen head (`A.json+B.json`: a later `linmem probe --only ... --component HEAD` run beside
the full one); an experiment in two of them is refused. Values are the records' own: means with their
source-bootstrap 95% intervals, margins in logits. A model that fails the probe's clean-recall gate gets a line
under the table instead of a column.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def ci(row: dict) -> str:
    """``mean [low, high]``, or the mean alone where the interval is a single point equal to it."""
    if row["low"] == row["high"] == row["mean"]:
        return f"{row['mean']:.2f}"
    return f"{row['mean']:.2f} [{row['low']:.2f}, {row['high']:.2f}]"


def signed(row: dict) -> str:
    """A change: ``+mean [low, high]``."""
    return f"{row['mean']:+.2f} [{row['low']:.2f}, {row['high']:.2f}]"


def small(x: float) -> str:
    """Two decimals, or one significant digit below 0.05 (the next head's score is often near zero)."""
    return f"{x:.2f}" if abs(x) >= 0.05 else f"{x:.1g}"


class Record:
    """One model's probe experiments, from one record or several of the same model and task (the first gives the
    header), looked up by their row fields."""

    def __init__(self, *paths: Path):
        first, *more = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
        self.header, self.experiments = first["header"], dict(first["experiments"])
        for path, data in zip(paths[1:], more):
            for key in ("model", "task", "chosen"):
                if data["header"].get(key) != self.header.get(key):
                    raise ValueError(f"{path}: its {key} {data['header'].get(key)!r} is not {paths[0]}'s "
                                     f"{self.header.get(key)!r}; a column joins records of one model, task and "
                                     "chosen head")
            for name, experiment in data["experiments"].items():
                if name == "clean_recall":
                    continue  # each run measures it; the first record's is the column's
                if name in self.experiments:
                    raise ValueError(f"{path}: {name} is in an earlier record of this column as well")
                self.experiments[name] = experiment

    def rows(self, experiment: str) -> list[dict]:
        return self.experiments.get(experiment, {}).get("rows", [])

    def summary(self, experiment: str) -> dict:
        return self.experiments.get(experiment, {}).get("summary", {})

    def row(self, experiment: str, **fields) -> dict:
        found = [r for r in self.rows(experiment) if all(r.get(k) == v for k, v in fields.items())]
        if len(found) != 1:
            raise KeyError(f"{experiment}: {len(found)} rows with {fields}")
        return found[0]

    def has(self, experiment: str) -> bool:
        return bool(self.rows(experiment))

    def measured(self, experiment: str) -> list[dict]:
        """The experiment's rows; ``KeyError`` (the cell says "not measured") when the record has none."""
        if not self.has(experiment):
            raise KeyError(experiment)
        return self.rows(experiment)


def head_scan(r: Record) -> str:
    s = r.summary("head_scan")
    ranked = sorted(r.rows("head_scan"), key=lambda x: x["rank"])
    best, runner = ranked[0], ranked[1]
    memory = {"S": " (base memory)", "R": " (residual memory)"}.get(best["memory"], "") \
        if any(x["memory"] == "R" for x in ranked) else ""
    return (f"{s['chosen']}{memory}, {s['top1_sources']} of {s['sources']}, {best['mean']:.2f} against "
            f"{small(runner['mean'])} for the next, {runner['component']} ({len(ranked)} components)")


def lifecycle(r: Record, intervention: str, target: str, metric: str) -> dict:
    return r.row("lifecycle", intervention=intervention, target=target, metric=metric)


def write_block(r: Record) -> str:
    clean = r.summary("lifecycle")["clean_accuracy"]["mean"]
    return (f"clean {clean:.2f} -> {ci(lifecycle(r, 'write block', 'chosen', 'edited_correct'))} "
            f"({ci(lifecycle(r, 'write block', 'control head', 'edited_correct'))})")


def donor_write(r: Record) -> str:
    return (f"{ci(lifecycle(r, 'donor write', 'chosen', 'donor_answer'))} "
            f"({ci(lifecycle(r, 'donor write', 'random', 'donor_answer'))})")


def state_swap(r: Record) -> str:
    s = r.summary("lifecycle")
    return (f"{ci(lifecycle(r, 'state swap', 'chosen', 'donor_margin_shift'))} "
            f"({ci(lifecycle(r, 'state swap', 'random', 'donor_margin_shift'))}); "
            f"{ci(lifecycle(r, 'state swap', 'chosen', 'qualified_donor_answer'))}, "
            f"{s['qualified_items']} of {s['items']} items qualify")


def output_patch(r: Record) -> str:
    swap = lifecycle(r, "state swap", "chosen", "donor_margin_shift")["mean"]
    return f"{ci(lifecycle(r, 'output patch', 'chosen', 'donor_margin_shift'))} vs {swap:.2f}"


def output_restore(r: Record) -> str:
    return (f"{ci(lifecycle(r, 'output restore', 'chosen', 'donor_margin_shift'))} "
            f"({ci(lifecycle(r, 'output restore', 'control head', 'donor_margin_shift'))})")


def interaction(r: Record) -> str:
    s = r.summary("head_interaction")
    change = {x["blocked"]: x["mean"] for x in r.rows("head_interaction") if x["metric"] == "target_margin_change"}
    verdict = "additive" if s["additive"] else "not additive"
    return (f"{s['hub']} {change['hub']:.2f} / {s['secondary']} {change['secondary']:.2f} / both "
            f"{change['both']:.2f}; {s['interaction']:.3f} [{s['low']:.3f}, {s['high']:.3f}], {verdict}")


def four_facts(r: Record) -> str:
    return (f"{ci(r.row('four_facts', fact='target', metric='donor_answer'))}; "
            f"{ci(r.row('four_facts', fact='non-target', metric='break_rate'))}")


def sweep(r: Record, experiment: str, field: str) -> str:
    rows = sorted((x for x in r.measured(experiment) if x["edit"] == "chosen" and x["metric"] == "clean_correct"),
                  key=lambda x: x[field])
    text = ", ".join(f"{x['mean']:.2f}" for x in rows)
    below = r.summary(experiment).get("below_clean_recall") or []
    return text + (f" ({', '.join(map(str, below))} below the gate)" if below else "")


def load_vs_gap(r: Record) -> str:
    s = r.summary("load_vs_gap")
    if not s:
        raise KeyError("load_vs_gap")

    def drops(metric: str) -> str:
        return " / ".join(ci(r.row("load_vs_gap", comparison=c, metric=metric))
                          for c in ("load drop", "gap drop", "load drop − gap drop"))

    return (f"K {s['loads'][0]} -> {s['loads'][1]} / gap {s['gaps'][0]} -> {s['gaps'][1]} / difference: recall "
            f"{drops('clean_correct')}; margin {drops('target_margin')}")


def overlap(r: Record) -> str:
    return " / ".join(ci(r.row("overlap", edit=e, metric="target_margin_change"))
                      for e in ("align", "orthogonal", "align, control head"))


def spearman(r: Record) -> str:
    s = r.summary("write_read_spearman")
    return f"{s['spearman']:.2f} [{s['low']:.2f}, {s['high']:.2f}] ({s['components']})"


def logit_lens(r: Record) -> str:
    layer = int(r.header["chosen"][1:].split("H")[0])
    values = [f"**{x['mean']:.2f}**" if x["layer"] == layer else f"{x['mean']:.2f}"
              for x in sorted(r.measured("logit_lens"), key=lambda x: x["layer"])]
    return ", ".join(values) + f" (L{layer})"


def neutral(r: Record) -> str:
    clean = r.row("neutral_suppression", fact="target", metric="clean_correct")["mean"]
    return (f"{clean:.2f} -> {ci(r.row('neutral_suppression', fact='target', metric='edited_correct'))}; "
            f"{signed(r.row('neutral_suppression', fact='other', metric='change'))}")


def joint_topk(r: Record) -> str:
    return " / ".join(ci(r.row("joint_topk", k=k, metric="share_of_full")) for k in (1, 2))


def corrector(r: Record) -> str:
    model = r.row("corrector", predictor="model", metric="accuracy")
    both = r.row("corrector", predictor="model+corrector", metric="accuracy")
    change = r.row("corrector", predictor="model+corrector − model", metric="accuracy_change")
    shuffled = r.row("corrector", predictor="shuffled labels", metric="accuracy")
    return f"{ci(model)} -> {ci(both)}, {signed(change)} ({shuffled['mean']:.2f})"


def subspace(r: Record, rank: int = 4) -> str:
    cell = {x["edit"]: x for x in r.rows("subspace_transfer")
            if x["metric"] == "donor_answer" and x["rank"] == rank and not x["full"]}
    return (f"{ci(cell['basis'])} / {cell['orthogonal']['mean']:.2f} / {cell['random']['mean']:.2f} / "
            f"{cell['own']['mean']:.2f}")


def s_vs_r(r: Record) -> str:
    if not r.has("s_vs_r"):
        return "—"
    layer = int(r.header["chosen"][1:].split("H")[0])
    share = {x["memory"]: x for x in r.rows("s_vs_r") if x["layer"] == layer and x["metric"] == "share_of_layer"}
    return f"base S {ci(share['S'])}, residual R {ci(share['R'])}"


def write_reach(r: Record) -> str:
    width = r.summary("write_reach")["conv_width"]

    def at(target: str, d: int, metric: str) -> dict:
        return r.row("write_reach", target=target, tokens_after=d, metric=metric)

    by_d = " / ".join(f"{at('chosen', d, 'edited_correct')['mean']:.2f}" for d in range(width + 1))
    reach = width - 1
    return (f"recall at d = 0-{width}: {by_d}; margin change at d = 0 "
            f"{signed(at('chosen', 0, 'target_margin_change'))}, at d = {reach} "
            f"{signed(at('chosen', reach, 'target_margin_change'))} "
            f"({signed(at('control head', reach, 'target_margin_change'))})")


def donor_reach(r: Record) -> str:
    width = r.summary("write_reach")["conv_width"]

    def at(target: str, d: int) -> dict:
        return r.row("write_reach", target=target, tokens_after=d, metric="donor_answer")

    by_d = " / ".join(f"{at('chosen', d)['mean']:.2f}" for d in range(width + 1))
    return f"donor answers at d = 0-{width}: {by_d}; at d = {width - 1} {ci(at('chosen', width - 1))} " \
           f"({at('control head', width - 1)['mean']:.2f})"


ROWS = [
    ("3: chosen head, first on development sources", head_scan),
    ("1: write block (control head)", write_block),
    ("1, widened: write block over the fact and the d tokens after it, d = W - 1 the short convolutions' reach "
     "(control head)", write_reach),
    ("2: donor write, donor answers (random write)", donor_write),
    ("2, widened: donor write over the fact and the d tokens after it (control head)", donor_reach),
    ("4: state swap, margin shift (random swap); qualified donor rate", state_swap),
    ("5: output patch vs state swap", output_patch),
    ("6: swap, then restore the head's output (the control head's)", output_restore),
    ("7: block hub / secondary / both; interaction", interaction),
    ("8: four-fact edit, target donor answers; non-target break rate", four_facts),
    ("12: clean recall at K = 1, 2, 4, 8", lambda r: sweep(r, "sweep_num_bindings", "num_bindings")),
    ("13: clean recall at gap 0, 128, 256 (K = 4)", lambda r: sweep(r, "sweep_gap", "gap")),
    ("13, paired: drop with more facts / with a longer gap (K = 4) / their difference, per source", load_vs_gap),
    ("14: aligned keys / orthogonalised / aligned at a control head", overlap),
    ("17: write/read Spearman over heads", spearman),
    ("18: logit lens by layer (chosen head's layer)", logit_lens),
    ("19: neutral state: target; other facts' change", neutral),
    ("21: joint top-1 / top-2 share of the full swap", joint_topk),
    ("22: corrector: model -> model + corrector (shuffled labels)", corrector),
    ("20 (D.2): donor answers, rank-4 colour basis / its complement / random / the edit's own rank 4", subspace),
    ("S vs R (RLA/RDN): share of the chosen layer's swap effect", s_vs_r),
]


def cell(record: Record, reader) -> str:
    try:
        return reader(record)
    except (KeyError, IndexError, StopIteration):
        return "not measured"


def table(columns: list[tuple[str, Record]]) -> str:
    """The Markdown table over the records that pass the clean-recall gate, and a line for each one that does not."""
    passed = [(label, r) for label, r in columns if r.header.get("clean_recall_passed")]
    lines = []
    if passed:
        lines += ["| row | " + " | ".join(label for label, _ in passed) + " |", "|---" * (len(passed) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(cell(r, reader) for _, r in passed) + " |" for name, reader in ROWS]
    gate = []
    for label, r in columns:
        recall, passes = r.header.get("clean_recall", {}), r.header.get("clean_recall_passed")
        gate.append(f"- {label}: clean recall {recall.get('development', float('nan')):.2f} / "
                    f"{recall.get('confirmation', float('nan')):.2f} (development / confirmation sources), "
                    f"{'at or above' if passes else 'below'} the gate {r.header.get('min_clean_recall', 0.5):g}")
    return "\n".join(lines) + ("\n\n" if lines else "") + "\n".join(gate) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="LABEL=results.json of `linmem probe`")
    parser.add_argument("--out", type=Path, help="write the table here as well")
    args = parser.parse_args()
    columns = []
    for item in args.records:
        label, sep, path = item.partition("=")
        if not sep or not label:
            parser.error(f"expected LABEL=RESULTS.json; got {item!r}")
        try:
            columns.append((label, Record(*(Path(p) for p in path.split("+")))))
        except ValueError as e:
            parser.error(str(e))
    text = table(columns)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
