"""Train zoo configs side by side, each at one or more peak learning rates; keep the better rate per config.

    python scripts/zoo/lr_race.py --out runs/race --seconds 1350 \
        transformer=2e-3 gdn=2e-3,5e-3 rdn=2e-3,5e-3 sgla=2e-3,5e-3 rla=2e-3,5e-3 gla=2e-3,5e-3 gdn-hybrid=2e-3,5e-3

Every ``NAME=LR[,LR...]`` starts ``linmem train configs/zoo/NAME.yaml`` once per rate (the config as it is, its
peak lr and a tenth of it as the floor replaced, held-out evaluation every 100 updates) in ``OUT/NAME-lrLR``.
When every rate of a config has reached ``--decide-step`` updates (or ``--decide-seconds`` have passed), the race
is decided at the last update all of them reached:

1. the highest held-out recall accuracy wins if any rate has reached ``--recall-bar`` (20%: the plateau of the
   zoo's recall mix sits at 4-7%), the lower training recall loss breaking a tie;
2. otherwise the lowest training recall loss over the 100 updates before it (the plateau at ln 512 is left
   first by the rate that will learn recall first).

With ``--seeds 0,1,2`` every config and rate runs once per train seed (``OUT/NAME-lrLR-seedS``), and the same rule
keeps one run per config: small models leave the recall plateau at a different update for each seed (the zoo's RLA
learned MQAR, NIAH and the facts in its first stage with seed 1 and not with seed 0), so a race of seeds keeps the
one that left it first.

The losers get SIGTERM (they write a checkpoint and stop). ``OUT/choices.json`` records every decision with its
figures; ``OUT/status.txt`` is rewritten every 15 s; a number written to ``OUT/deadline`` replaces ``--seconds``.
After ``--seconds`` every run still going is stopped with a checkpoint and, if it is a winner, finalised where it
stopped (``--resume --max-steps`` at its last update: the model card then says how many updates it had). Each
winner is evaluated as soon as it is done (``linmem zoo ship RUN --ship none``, cached in ``RUN/zoo/eval.json``);
with ``--ship`` the winners are then shipped into ``OUT/zoo`` with the zoo page in ``OUT/docs/zoo.md``, and
``OUT/fetch/`` gets one tar per shipped model and one with the page, the held-out text and every run's config,
metrics and log. ``OUT/finished`` (the winners, as JSON) is written last: wait for it with
``while [ ! -f OUT/finished ]; do sleep 5; done`` (a ``pgrep -f lr_race.py`` loop matches its own shell).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "zoo"
sys.path.insert(0, str(HERE / "recall-sweep"))
from make_variants import variant  # noqa: E402  (the sweep's config rewriter: lr, min lr, eval cadence)

from linmem.train.config import read_config_dict  # noqa: E402

POLL_SECONDS = 15
FINISHED = "finished"  # OUT/finished: written when the race, its evaluations and shipping are all over
RECALL_BAR = 0.2  # held-out recall accuracy that counts as learning: the zoo mix's plateau sits at 0.04-0.07


@dataclass
class Entry:
    """One training process of the race: config ``name`` at peak ``lr``."""

    name: str
    lr: float
    folder: Path
    seed: int | None = None  # the config's train.seed replaced (--seeds), else as the config has it
    process: subprocess.Popen | None = None
    status: str = "running"  # running, stopped (lost the race), done, finalised, failed
    rows: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}-lr{self.lr:g}" + ("" if self.seed is None else f"-seed{self.seed}")

    def read(self) -> None:
        path = self.folder / "metrics.jsonl"
        if path.is_file():
            self.rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]

    @property
    def step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    @property
    def finished(self) -> bool:
        return (self.folder / "model" / "train_info.json").is_file()

    def accuracy_at(self, step: int) -> float | None:
        evals = [r["val_recall_acc"] for r in self.rows if "val_recall_acc" in r and r["step"] <= step]
        return evals[-1] if evals else None

    def recall_loss_before(self, step: int, window: int = 100) -> float:
        losses = [r["recall_loss"] for r in self.rows
                  if step - window < r["step"] <= step and r.get("recall_loss") is not None]
        finite = [x for x in losses if math.isfinite(x)]
        return statistics.mean(finite) if finite and len(finite) == len(losses) else math.inf


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed is given twice")
    return seeds


def parse_plan(items: list[str], configs_dir: Path) -> dict[str, list[float]]:
    plan = {}
    for item in items:
        name, _, rates = item.partition("=")
        if not (configs_dir / f"{name}.yaml").is_file():
            raise SystemExit(f"no config {configs_dir / name}.yaml")
        try:
            plan[name] = [float(r) for r in rates.split(",")]
        except ValueError:
            raise SystemExit(f"{item!r}: expected NAME=LR[,LR...]") from None
    return plan


def resolved_text(path: Path) -> str:
    """The config at ``path`` as one YAML text with its ``include:`` files merged in (the rewriter edits text, and
    the variant is written to another folder, where a relative include would not resolve)."""
    return yaml.safe_dump(read_config_dict(path), sort_keys=False)


def launch(entry: Entry, python: str, configs_dir: Path, configs: Path) -> None:
    config = configs / f"{entry.label}.yaml"
    config.write_text(variant(resolved_text(configs_dir / f"{entry.name}.yaml"), lr=entry.lr, seed=entry.seed))
    entry.folder.parent.mkdir(parents=True, exist_ok=True)
    resume = ["--resume"] if entry.folder.is_dir() else []  # an interrupted race continues its runs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(entry.folder.parent / f"{entry.label}.log", "ab") as log:  # the child keeps its own copy of the handle
        entry.process = subprocess.Popen([python, "-m", "linmem.cli", "train", str(config), "--out",
                                          str(entry.folder), *resume, "--no-progress"],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)


def decide(group: list[Entry], recall_bar: float) -> tuple[Entry, dict]:
    """The winner of a config's race and the figures it was chosen on."""
    step = min(e.step for e in group)
    figures = {e.label: {"step": e.step, "recall_acc": e.accuracy_at(step), "recall_loss": e.recall_loss_before(step)}
               for e in group}
    accuracies = {e.label: e.accuracy_at(step) or 0.0 for e in group}
    if max(accuracies.values()) >= recall_bar:
        winner = max(group, key=lambda e: (accuracies[e.label], -e.recall_loss_before(step)))
        rule = f"highest held-out recall accuracy at update {step} (at least {recall_bar:g})"
    else:
        winner = min(group, key=lambda e: (e.recall_loss_before(step), -e.lr))
        rule = (f"lowest training recall loss over updates {max(1, step - 99)}-{step} "
                f"(no rate at {recall_bar:g} accuracy yet)")
    return winner, {"decided_at_update": step, "rule": rule, "winner": winner.label, "lr": winner.lr,
                    "seed": winner.seed, "figures": figures}


def status_table(entries: list[Entry], elapsed: float) -> str:
    lines = [f"race at {elapsed:.0f} s", f"{'run':26} {'status':10} {'step':>5} {'loss':>7} {'recall_loss':>11} "
             f"{'val_loss':>8} {'recall_acc':>10} {'tok/s':>8}"]
    for e in entries:
        last = e.rows[-1] if e.rows else {}
        evals = [r for r in e.rows if "val_loss" in r]
        ev = evals[-1] if evals else {}
        speed = statistics.median([r["tokens_per_s"] for r in e.rows[-50:]]) if e.rows else 0
        lines.append(f"{e.label:26} {e.status:10} {e.step:>5} {last.get('loss', math.nan):>7.3f} "
                     f"{e.recall_loss_before(e.step):>11.3f} {ev.get('val_loss', math.nan):>8.3f} "
                     f"{ev.get('val_recall_acc', math.nan):>10.3f} {speed:>8.0f}")
    return "\n".join(lines) + "\n"


def stop(entries: list[Entry], grace: float = 120.0) -> None:
    """SIGTERM each running process (a checkpoint follows) and wait for them."""
    for e in entries:
        if e.process is not None and e.process.poll() is None:
            e.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for e in entries:
        if e.process is not None:
            try:
                e.process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                e.process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", nargs="+", help="NAME=LR[,LR...]: a config of configs/zoo and its peak rates")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=0, help="stop training after this long (0: no limit)")
    parser.add_argument("--decide-step", type=int, default=600)
    parser.add_argument("--decide-seconds", type=float, default=420)
    parser.add_argument("--recall-bar", type=float, default=RECALL_BAR)
    parser.add_argument("--ship", action="store_true", help="ship the winners into OUT/zoo and pack OUT/fetch")
    parser.add_argument("--device", default="auto", help="evaluation device")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--poll-seconds", type=float, default=POLL_SECONDS, help="how often the runs are read")
    parser.add_argument("--configs-dir", type=Path, default=CONFIGS, help="where NAME.yaml are (default: configs/zoo)")
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="comma-separated train seeds: every config and rate runs once per seed (the config's "
                             "own seed when not given)")
    args = parser.parse_args()
    plan = parse_plan(args.plan, args.configs_dir)
    seeds = args.seeds or [None]
    configs = args.out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    entries = [Entry(name, lr, Path(), seed) for name, rates in plan.items() for lr in rates for seed in seeds]
    for e in entries:
        e.folder = args.out / e.label
    for e in entries:
        launch(e, args.python, args.configs_dir, configs)
    choices_path = args.out / "choices.json"
    choices = json.loads(choices_path.read_text()) if choices_path.is_file() else {}
    winners = {name: next(e for e in entries if e.name == name) for name, rates in plan.items()
               if len(rates) * len(seeds) == 1}
    for name, choice in choices.items():
        winners[name] = next(e for e in entries if e.label == choice["winner"])
    evaluations: dict[str, subprocess.Popen] = {}
    (args.out / FINISHED).unlink(missing_ok=True)
    started = time.monotonic()

    def evaluate(e: Entry) -> None:
        with open(args.out / f"{e.label}.eval.log", "ab") as log:  # the child keeps its own copy of the handle
            evaluations[e.name] = subprocess.Popen(
                [args.python, "-m", "linmem.cli", "zoo", "ship", str(e.folder), "--ship", "none", "--device",
                 args.device], stdout=log, stderr=subprocess.STDOUT)

    while True:
        elapsed = time.monotonic() - started
        deadline = args.out / "deadline"  # a number of seconds written there replaces --seconds (a lease running out)
        if deadline.is_file():
            args.seconds = float(deadline.read_text())
        at_deadline = bool(args.seconds) and elapsed >= args.seconds  # open races are decided where they stand
        for e in entries:
            e.read()
            if e.status == "running" and e.process.poll() is not None:
                e.status = "done" if e.finished else "failed"
        for name in plan:
            if name in winners:
                continue
            group = [e for e in entries if e.name == name]
            alive = [e for e in group if e.status in ("running", "done")]
            if not alive:
                continue
            if len(alive) == 1:
                winners[name] = alive[0]
                choices[name] = {"winner": alive[0].label, "lr": alive[0].lr, "seed": alive[0].seed,
                                 "rule": "the only run not failed"}
            elif (min(e.step for e in alive) >= args.decide_step or all(e.status == "done" for e in alive)
                  or (elapsed >= args.decide_seconds and min(e.step for e in alive) >= 100) or at_deadline):
                winners[name], choices[name] = decide(alive, args.recall_bar)
                if at_deadline:
                    choices[name]["rule"] += " (at the deadline)"
                for e in alive:
                    if e is not winners[name] and e.status == "running":
                        e.process.send_signal(signal.SIGTERM)
                        e.status = "stopped"
            else:
                continue
            choices_path.write_text(json.dumps(choices, indent=2))
        for name, e in winners.items():
            if e.status == "done" and name not in evaluations:
                evaluate(e)
        (args.out / "status.txt").write_text(status_table(entries, elapsed))
        running = [e for e in entries if e.status == "running"]
        if not running:
            break
        if at_deadline:
            stop(entries)  # the winners still running, and any loser stopped just now
            for e in running:
                e.read()
                e.status = "done" if e.finished else "stopped"
                if winners.get(e.name) is e and not e.finished and e.step > 0:
                    with open(args.out / f"{e.label}.log", "ab") as log:
                        subprocess.run([args.python, "-m", "linmem.cli", "train", str(configs / f"{e.label}.yaml"),
                                        "--out", str(e.folder), "--resume", "--max-steps", str(e.step),
                                        "--no-progress"], stdout=log, stderr=subprocess.STDOUT)
                    e.status = "finalised" if e.finished else "failed"
                    if e.finished:
                        evaluate(e)
            break
        time.sleep(args.poll_seconds)
    for proc in evaluations.values():
        proc.wait()
    (args.out / "status.txt").write_text(status_table(entries, time.monotonic() - started))
    print((args.out / "status.txt").read_text(), flush=True)
    done = [e for e in winners.values() if e.finished]
    if args.ship and done:
        ship(done, args)
    # the last thing written: a caller waiting on the race (e.g. a follow-up command) polls for this file
    summary = {"winners": [e.label for e in done], "shipped": bool(args.ship and done)}
    (args.out / FINISHED).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def ship(done: list[Entry], args: argparse.Namespace) -> None:
    """Ship the finished winners into OUT/zoo, write OUT/docs/zoo.md, pack OUT/fetch."""
    zoo_dir, docs = args.out / "zoo", args.out / "docs" / "zoo.md"
    command = [args.python, "-m", "linmem.cli", "zoo", "ship", "--zoo-dir", str(zoo_dir), "--device", args.device]
    from linmem.zoo import MAIN

    shipped = [e.name for e in done if e.name in MAIN  # one at a time: a model over the size limit stops only itself
               and subprocess.run([*command, str(e.folder), "--ship", e.name], check=False).returncode == 0]
    subprocess.run([*command, *[str(e.folder) for e in done], "--ship", ",".join(shipped) or "none",
                    "--docs", str(docs)], check=False)
    fetch = args.out / "fetch"
    fetch.mkdir(exist_ok=True)
    for model in sorted(p for p in zoo_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        with tarfile.open(fetch / f"{model.name}.tar.xz", "w:xz") as tar:
            tar.add(model, arcname=model.name)
    with tarfile.open(fetch / "zz-records.tar.gz", "w:gz") as tar:
        for p in sorted(zoo_dir.iterdir()):
            if p.name.startswith("_"):
                tar.add(p, arcname=f"zoo/{p.name}")
        tar.add(docs.parent, arcname="docs")
        for name in ("choices.json", "status.txt", "configs"):
            if (args.out / name).exists():
                tar.add(args.out / name, arcname=f"race/{name}")
        for log in sorted(args.out.glob("*.log")):
            tar.add(log, arcname=f"race/{log.name}")
        for e_dir in sorted(p for p in args.out.iterdir() if (p / "metrics.jsonl").is_file()):
            tar.add(e_dir / "metrics.jsonl", arcname=f"race/{e_dir.name}/metrics.jsonl")
            for extra in ("zoo/eval.json", "config.yaml"):
                if (e_dir / extra).is_file():
                    tar.add(e_dir / extra, arcname=f"race/{e_dir.name}/{extra}")
    print("packed:", *sorted(p.name for p in fetch.iterdir()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
