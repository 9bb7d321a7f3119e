"""``linmem zoo list``, ``linmem zoo ship RUN_DIR [RUN_DIR ...] [--ship NAME,...] [--docs docs/zoo.md]`` and
``linmem zoo remeasure NAMES --tasks TASKS --why TEXT``.

Only argparse and the standard library load with this module; each command imports what it runs, so that the
commands' help and argument errors answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", metavar="{list,ship,remeasure}", required=True)
    listing = sub.add_parser("list", help="the shipped models with their size and headline numbers")
    listing.add_argument("--zoo-dir", default=None, help="zoo folder (default: $LINMEM_ZOO_DIR or the package's)")
    listing.set_defaults(func=run_list)
    ship = sub.add_parser("ship", help="evaluate trained runs, package the chosen ones into the zoo, write the docs",
                          description="Evaluate each run folder's final model (bfloat16, as shipped) with every "
                                      "linmem eval task into RUN/zoo/eval.json; package the --ship runs into the zoo "
                                      "with a model card; write --docs over all runs.")
    ship.add_argument("runs", nargs="+", type=Path, help="run folders of linmem train (OUT with model/ and "
                                                          "metrics.jsonl)")
    ship.add_argument("--ship", type=_names, default=None,
                      help="comma-separated run names to package (default: the main models sgla, gla, gdn, rla, "
                           "rdn, gdn-hybrid, transformer among the runs); 'none' packages nothing")
    ship.add_argument("--docs", type=Path, default=None, help="write the zoo page here (e.g. docs/zoo.md) with its "
                                                              "figures in a folder beside it")
    ship.add_argument("--zoo-dir", default=None, help="zoo folder (default: $LINMEM_ZOO_DIR or the package's)")
    ship.add_argument("--data", default=None, help="the runs' dataset folder, if not where train_info.json says")
    ship.add_argument("--device", default="auto", help="evaluation device (default: cuda if present)")
    ship.add_argument("--force-eval", action="store_true", help="re-evaluate even if RUN/zoo/eval.json is current")
    ship.add_argument("--overwrite", action="store_true",
                      help="ship into a non-empty --zoo-dir that is not a linmem zoo (its other files are kept)")
    ship.set_defaults(func=run_ship)
    again = sub.add_parser("remeasure", help="run evaluation tasks again on shipped models (a task's protocol "
                                             "changed) and update their eval.json and model card",
                           description="Run --tasks again on the shipped models NAMES with the settings their "
                                       "eval.json was made with, on the zoo's held-out text; replace those tasks' "
                                       "results, record when and why, and re-render the model card.")
    again.add_argument("names", type=_names, help="comma-separated shipped model names, or 'all'")
    again.add_argument("--tasks", required=True, help="comma-separated linmem eval tasks, e.g. cloze")
    again.add_argument("--why", required=True, help="what changed: kept in eval.json under eval.remeasured")
    again.add_argument("--zoo-dir", default=None, help="zoo folder (default: $LINMEM_ZOO_DIR or the package's)")
    again.add_argument("--device", default="recorded",
                       help="evaluation device (default: 'recorded', each task on the device its current numbers "
                            "were measured on, so an unchanged protocol reproduces them)")
    again.set_defaults(func=run_remeasure)


HEADLINE_PAIRS = 8  # the MQAR size and NIAH length the README, `zoo list` and the demo all quote
HEADLINE_LENGTH = 256
CARD_COLUMNS = ("test ppl", "ppl measured on", f"MQAR {HEADLINE_PAIRS}", "MQAR mean", f"NIAH {HEADLINE_LENGTH}",
                "NIAH mean", "lab recall [95% CI]")


def card_numbers(record: dict) -> dict[str, str]:
    """A model card's (``eval.json``'s) headline numbers, formatted, under ``CARD_COLUMNS``' names."""
    from linmem.eval.descriptions import measured_on
    from linmem.zoo.cards import fmt, headline, recall_cell

    h = headline(record["eval"]["tasks"]) if record else {}
    ppl = record["eval"]["tasks"].get("ppl", {}).get("metrics") if record else None
    values = (fmt(h.get("ppl"), 1), measured_on(ppl) if ppl else "–", fmt(h.get("mqar", {}).get(HEADLINE_PAIRS), 2),
              fmt(h.get("mqar_mean"), 2),
              fmt(h.get("niah", {}).get(HEADLINE_LENGTH), 2), fmt(h.get("niah_mean"), 2), recall_cell(h))
    return dict(zip(CARD_COLUMNS, values))


def card_legend(records: list[dict]) -> list[str]:
    """What each of ``CARD_COLUMNS`` is (split, task setting, trials), from the first card's evaluation request;
    a sentence says so where the cards were measured with different settings."""
    measured = [r for r in records if r]
    if not measured:
        return []
    o = measured[0]["eval"]["request"]["options"]
    tasks = measured[0]["eval"]["tasks"]
    depths, pairs, lengths = len(o["niah_depths"]), o["mqar_pairs"], o["niah_lengths"]
    recall = tasks.get("recall", {}).get("metrics", {})
    lines = [
        "Every number is the model card's (eval.json, measured by `linmem zoo ship`) on the test split of the "
        "held-out text shipped beside each model.",
        "test ppl: perplexity on the tokens its next column names.",
        f"MQAR {HEADLINE_PAIRS}: accuracy with {HEADLINE_PAIRS} key-value pairs, {o['mqar_samples']} sequences of "
        f"{HEADLINE_PAIRS} queries; MQAR mean: the mean of the accuracies at {', '.join(map(str, pairs))} pairs.",
        f"NIAH {HEADLINE_LENGTH}: accuracy at {HEADLINE_LENGTH} tokens, {o['niah_samples']} trials at each of "
        f"{depths} needle depths ({o['niah_samples'] * depths} trials); NIAH mean: the mean over "
        f"{', '.join(map(str, lengths))} tokens x {depths} depths.",
        f"lab recall: the memory lab's clean 4-choice recall (chance 0.25) on {recall.get('n', '?')} items from "
        f"{recall.get('sources', '?')} source passages, with a source-bootstrap 95% CI.",
    ]
    if any(r["eval"]["request"]["options"] != o for r in measured[1:]):
        lines.append("Some cards were measured with other settings: each model card says which.")
    return [line for line in lines if line]


def run_list(args: argparse.Namespace) -> int:
    import linmem.zoo as zoo
    from linmem.zoo.cards import fmt

    names = zoo.names(args.zoo_dir)
    if not names:
        print(f"no models shipped in {zoo.root(args.zoo_dir)} (linmem zoo ship RUN_DIR ... packages them)")
        return 0
    records = {n: zoo.eval_record(n, args.zoo_dir) if (zoo.path(n, args.zoo_dir) / "eval.json").is_file() else {}
               for n in names}
    widths = (10, -26, 8, 11, 10, 11, 0)  # the recall cell last, left-aligned after two spaces

    def line(cells) -> str:
        return "".join(f"{c:>{w}}" if w > 0 else f"  {c:<{-w}}" for c, w in zip(cells, widths))

    print(f"{'name':<14}{'params':>11}{'MB':>7}" + line(CARD_COLUMNS))
    for name, record in records.items():
        size = zoo.folder_bytes(zoo.path(name, args.zoo_dir)) / 1e6
        print(f"{name:<14}{fmt(record.get('parameters')):>11}{size:>7.2f}" + line(card_numbers(record).values()))
    print("\n".join(card_legend(list(records.values()))))
    return 0


def run_ship(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from transformers.utils import logging as hf_logging

    from linmem.zoo.ship import SHIP_EVAL, ship

    hf_logging.disable_progress_bar()
    names = [] if args.ship == ["none"] else args.ship
    ship(args.runs, names, zoo_dir=args.zoo_dir, docs=args.docs, options=replace(SHIP_EVAL, device=args.device),
         data=args.data, force=args.force_eval, overwrite=args.overwrite)
    return 0


def run_remeasure(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from linmem import zoo
    from linmem.eval.task_names import parse_tasks
    from linmem.zoo.ship import remeasure

    hf_logging.disable_progress_bar()
    names = zoo.names(args.zoo_dir) if args.names == ["all"] else args.names
    remeasure(names, parse_tasks(args.tasks), args.why, zoo_dir=args.zoo_dir, device=args.device)
    return 0
