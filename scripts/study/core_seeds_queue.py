"""The next queues of a many-seed study on the lent GPU: each unfinished run of a model whose peak rate is set,
grouped so that both arms of a comparison train at the same seed in the same queue.

    python scripts/study/core_seeds_queue.py configs/study/core-seeds.yaml runs/study/core-seeds [--size 12]
        [--models NAME ...]

A model is ready when the study file sets its ``optim.lr`` (its rate race is decided; core-seeds.yaml's header says
so), and waits otherwise. A run is finished when ``linmem study`` has evaluated it (``is_finished``). The pending
runs of the ready models are cut into units, one seed's runs of one connected group of the study's ``compare`` pairs,
and each unit goes whole into the first queue of at most ``--size`` runs with room for it: a comparison's two arms at
one seed never land in different queues (where one machine given back would leave a pair half run), and the queues
fill up. Each queue prints as one line of ``MODEL:SEED`` words for ``core_seeds_device.sh start``, earliest seeds
first. ``--models`` keeps the runs of those models only (a machine that holds none of the study's earlier runs queues
the models whose rates it has just set).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from linmem.study.definition import Study, load_study
from linmem.study.runs import is_finished


def ready_models(study: Study) -> tuple[list[str], list[str]]:
    """The study's models whose file sets ``optim.lr`` (ready) and the others (waiting), each in file order."""
    ready = [m.name for m in study.models if "optim.lr" in m.overrides]
    return ready, [m.name for m in study.models if m.name not in ready]


def comparison_groups(study: Study, models: list[str]) -> list[list[str]]:
    """``models`` split into the connected groups of the study's ``compare`` pairs (each group in file order)."""
    group_of = {name: {name} for name in models}
    for a, b in study.compare:
        if a in group_of and b in group_of and group_of[a] is not group_of[b]:
            merged = group_of[a] | group_of[b]
            for name in merged:
                group_of[name] = merged
    groups, seen = [], set()
    for name in models:
        if id(group_of[name]) not in seen:
            seen.add(id(group_of[name]))
            groups.append([m for m in models if m in group_of[name]])
    return groups


def pending_runs(study: Study, out: Path, models: list[str]) -> dict[int, list[str]]:
    """Per seed, the models of ``models`` whose run at that seed has not finished under ``out`` (seeds in order)."""
    pending = {}
    for seed in study.seeds:
        names = [name for name in models if not is_finished(out, name, seed)]
        if names:
            pending[seed] = names
    return pending


def _pieces(unit: list[tuple[str, int]], size: int) -> list[list[tuple[str, int]]]:
    """A unit longer than a queue, cut into queue-sized pieces (a group of more than ``size`` models cannot stay
    whole)."""
    return [unit[i:i + size] for i in range(0, len(unit), size)]


def queues(study: Study, out: Path, size: int, models: list[str] | None = None) -> list[list[tuple[str, int]]]:
    """The pending runs of the ready models (of those in ``models`` where given) as queues of at most ``size`` runs
    (module docstring): the units are one seed's pending runs of one comparison group, taken by seed and group
    order, each into the first queue with room for all of it (a new queue where none has)."""
    if size < 1:
        raise ValueError(f"a queue holds at least one run; got --size {size}")
    ready, _ = ready_models(study)
    if models is not None:
        unknown = [name for name in models if name not in study.model_names]
        if unknown:
            raise ValueError(f"{study.name} has no model {', '.join(unknown)}")
        ready = [name for name in ready if name in models]
    groups = comparison_groups(study, ready)
    result: list[list[tuple[str, int]]] = []
    for seed, names in pending_runs(study, out, ready).items():
        for group in groups:
            unit = [(name, seed) for name in group if name in names]
            for piece in _pieces(unit, size):
                room = next((queue for queue in result if len(queue) + len(piece) <= size), None)
                if room is None:
                    result.append(piece)
                else:
                    room.extend(piece)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study file (YAML)")
    parser.add_argument("out", type=Path, help="the study's folder (its runs/ holds the finished runs)")
    parser.add_argument("--size", type=int, default=12, help="runs per queue (12)")
    parser.add_argument("--models", nargs="*", help="only these models' runs")
    args = parser.parse_args(argv)
    study = load_study(args.study)
    ready, waiting = ready_models(study)
    if args.models is not None:
        ready = [name for name in ready if name in args.models]
        waiting = [name for name in waiting if name in args.models]
    try:
        planned = queues(study, args.out, args.size, args.models)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    total = sum(len(queue) for queue in planned)
    print(f"{study.name}: {total} runs of {len(ready)} ready models in {len(planned)} queues of at most {args.size}")
    for queue in planned:
        print(" ".join(f"{name}:{seed}" for name, seed in queue))
    if waiting:
        print(f"waiting for their rate (no optim.lr in the study file): {', '.join(waiting)} "
              f"({len(waiting) * len(study.seeds)} runs)")


if __name__ == "__main__":
    main()
