"""``linmem study STUDY.yaml --out DIR [--seeds 0,1,2] [--only MODEL ...] [--device D] [--set KEY=VALUE]
[--report-only]``.

Trains and evaluates every (model, seed) of the study not yet finished in ``--out`` (an interrupted one resumes),
then rebuilds ``--out/tables`` from the run folder; ``--report-only`` only rebuilds the tables, after
checking every finished run against the study file as it is now (config and evaluation settings).

Only argparse and the standard library load with this module; ``run`` imports the study, so that the help and
argument errors answer at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="study file (YAML: recipe, models, seeds, eval, compare)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default runs/study/NAME)")
    parser.add_argument("--seeds", default=None, help="comma-separated subset of the study's seeds to run "
                        "(default: all; the tables always cover every seed and say which are missing)")
    parser.add_argument("--only", nargs="+", default=None, metavar="MODEL", help="run only these models")
    parser.add_argument("--device", default="auto", help="training and evaluation device (auto, cpu, cuda)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting that changes no update, for every run started (e.g. train.compile=true, "
                        "train.micro_batch_size=16); the recipe's own keys are refused")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the tables from --out, run nothing (every finished run is checked against the "
                        "study file)")
    parser.add_argument("--no-figures", action="store_true", help="tables without figures")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from linmem.study.definition import check_settings, load_study
    from linmem.study.runs import check_finished_runs, check_study_folder, parse_seeds, run_study, write_study_record
    from linmem.study.tables import write_tables

    study = load_study(args.config)
    check_settings(args.settings)
    out = args.out or Path("runs") / "study" / study.name
    seeds = parse_seeds(args.seeds, study)
    if args.report_only:
        if not out.is_dir():
            raise FileNotFoundError(f"--report-only: no run folder at {out}")
        check_study_folder(out, study)
        check_finished_runs(out, study)
        write_study_record(out, study)  # the record states the file the tables were built from
    else:
        progress = run_study(study, out, seeds, args.only, args.device, not args.no_progress, args.settings)
        print(f"{len(progress.done)} run(s) trained and evaluated, {len(progress.skipped)} already finished")
        if progress.interrupted:
            model, seed = progress.interrupted
            print(f"stopped during {model} seed {seed}: its checkpoint is written; run the same command to resume")
    folder = write_tables(study, out, figures=not args.no_figures)
    print(f"tables in {folder / 'results.md'}")
    return 130 if not args.report_only and progress.interrupted else 0
