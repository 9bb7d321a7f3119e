"""``evaluate(model_dir, tasks, options)``: run the chosen tasks and write ``results.json``, ``results.md`` and
the figures into one folder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from linmem.eval import plots
from linmem.eval.cloze import cloze
from linmem.eval.descriptions import describe_perplexity
from linmem.eval.loading import EvalModel, load_model, open_heldout
from linmem.eval.memory_recall import RecallFormat, check_format, check_loads, check_recall_loads, memory_recall
from linmem.eval.mqar import mqar
from linmem.eval.niah import niah
from linmem.eval.perplexity import perplexity
from linmem.eval.stability import stability
from linmem.eval.task_names import TASKS  # noqa: F401 (re-exported: the tasks evaluate knows)
from linmem.io.atomic import atomic_write, write_json_atomic
from linmem.io.environment import environment
from linmem.io.folders import check_output_folder, output_file, output_folder
from linmem.io.models import default_output_folder
from linmem.io.run_info import total_tokens

NEEDS_TEXT = {"ppl", "cloze", "niah", "stability", "recall"}


@dataclass
class EvalOptions:
    """Sizes of every task; ``seq_len`` None means the model's training length. The recall task's format is
    ``recall_template`` / ``recall_keys`` / ``recall_values`` (names of the memory lab's templates and
    vocabularies, or files) at each load of ``recall_bindings`` (numbers of facts), ``recall_items`` items each."""

    data: str | None = None
    split: str = "test"
    seq_len: int | None = None
    batch_size: int = 8
    max_tokens: int = 262_144
    cloze_examples: int = 500
    mqar_pairs: Sequence[int] = (2, 4, 8, 16, 32, 64)
    mqar_samples: int = 64
    niah_lengths: Sequence[int] = (256, 512, 1024, 2048)
    niah_depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0)
    niah_samples: int = 20
    stability_windows: int = 16
    recall_items: int = 64
    recall_filler: int = 256
    recall_template: str = "code"
    recall_keys: str = "names"
    recall_values: str = "colors"
    recall_bindings: Sequence[int] = (4,)
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        self.recall_bindings = check_loads(self.recall_bindings, "recall_bindings")
        check_format(self.recall_format())

    def recall_format(self) -> RecallFormat:
        return RecallFormat(self.recall_template, self.recall_keys, self.recall_values,
                            filler_tokens=self.recall_filler)


def run_task(name: str, em: EvalModel, split, o: EvalOptions) -> dict[str, Any]:
    seq_len = o.seq_len or em.seq_len
    if name == "ppl":
        return perplexity(em, split, seq_len, o.max_tokens, o.batch_size)
    if name == "cloze":
        return cloze(em, split, o.cloze_examples, batch_size=o.batch_size)
    if name == "mqar":
        return mqar(em, o.mqar_pairs, seq_len, o.mqar_samples, o.seed, batch_size=o.batch_size)
    if name == "niah":
        return niah(em, split, o.niah_lengths, o.niah_depths, o.niah_samples, o.seed, o.batch_size)
    if name == "stability":
        return stability(em, split, seq_len, o.stability_windows, o.batch_size)
    return memory_recall(em, split, o.recall_items, filler_tokens=o.recall_filler, template=o.recall_template,
                         keys=o.recall_keys, values=o.recall_values, loads=o.recall_bindings, seed=o.seed,
                         batch_size=o.batch_size)


def evaluate(model_dir: str | Path, tasks: Sequence[str], options: EvalOptions | None = None,
             out_dir: str | Path | None = None, progress: bool = True, backend: str = "auto") -> dict[str, Any]:
    """Run ``tasks`` on a model folder, its mixers on the op ``backend``; writes the report into ``out_dir``
    (default ``MODEL_DIR/eval``)."""
    o = options or EvalOptions()
    em = load_model(model_dir, o.device, backend=backend)
    # default MODEL_DIR/eval, refused for a model inside the installed package (a zoo model) or a read-only one
    out = Path(out_dir) if out_dir else default_output_folder(em.folder, "eval")
    check_output_folder(out, overwrite=True, kind="eval", files=plots.report_files(tasks))  # a refusal costs no work
    split = open_heldout(em, o.data, o.split) if NEEDS_TEXT & set(tasks) else None  # fail before any work
    if "recall" in tasks:  # a load the tokenizer cannot supply is refused here, before any task runs
        check_recall_loads(em.tokenizer, o.recall_format(), o.recall_bindings)
    results: dict[str, Any] = {}
    bar = tqdm(tasks, desc="eval", unit="task", disable=not progress, dynamic_ncols=True)
    for name in bar:
        bar.set_postfix(task=name)
        start = time.perf_counter()
        results[name] = {**run_task(name, em, split, o), "seconds": round(time.perf_counter() - start, 2)}
    report = {"model": str(em.folder), "name": em.info.get("name", em.folder.name),
              "parameters": sum(p.numel() for p in em.model.parameters()), "trained_tokens": total_tokens(em.info),
              "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(o).items()},
              "environment": environment(next(em.model.parameters()).device), "tasks": results}
    write_report(report, out)
    return report


def write_report(report: dict[str, Any], out: Path) -> None:
    """``results.json``, figures (if matplotlib is installed) and ``results.md``. The folder is marked as
    linmem's; files linmem did not write stay, and a write that would replace one (or follow a link) is refused."""
    with output_folder(out, overwrite=True, kind="eval", files=plots.report_files(report["tasks"])):
        report["figures"] = make_figures(report, out)
        write_json_atomic(output_file(out, "results.json"), report)
        with atomic_write(output_file(out, "results.md"), "w") as f:
            f.write(markdown(report))


def make_figures(report: dict[str, Any], out: Path) -> dict[str, str]:
    tasks, name, figures = report["tasks"], report["name"], {}
    if not plots.have_matplotlib():
        return {}
    if "niah" in tasks:
        figures["niah"] = plots.niah_heatmap(tasks["niah"]["grid"], figure_path(out, "niah"), f"{name}: NIAH").name
    if "stability" in tasks:
        figures["stability"] = plots.stability_plot(tasks["stability"]["table"], figure_path(out, "stability"),
                                                    f"{name}: per-layer norms").name
    if "mqar" in tasks:
        figures["mqar"] = plots.mqar_plot(tasks["mqar"]["table"], figure_path(out, "mqar"), f"{name}: MQAR").name
    return figures


def figure_path(out: Path, task: str) -> Path:
    """Where task ``task``'s figure goes in the report folder ``out`` (``linmem.io.folders.output_file``)."""
    return output_file(out, plots.FIGURE_FILES[task])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "–" if value is None else str(value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    header = list(rows[0])
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_fmt(r[k]) for k in header) + " |" for r in rows)]


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown page: a summary table, then each task's table or grid and figure."""
    lines = [f"# Evaluation of {report['name']}", "", f"Model folder: `{report['model']}`, "
             f"{report['parameters']:,} parameters, trained tokens: {_fmt(report['trained_tokens'])}.", ""]
    for name, result in report["tasks"].items():
        lines += [f"## {name}", ""]
        if result.get("available") is False:
            lines += [result["reason"], ""]
            continue
        if name == "ppl":
            metrics = result["metrics"]
            lines += [f"{metrics['split'].capitalize()} perplexity {describe_perplexity(metrics)}.", ""]
        lines += _table([{"metric": k, "value": v} for k, v in result.get("metrics", {}).items()]) + [""]
        if "table" in result:
            lines += _table(result["table"]) + [""]
        if "grid" in result:
            grid = result["grid"]
            rows = [{"length": n, **{f"depth {d:.0%}": a for d, a in zip(grid["depths"], row)}}
                    for n, row in zip(grid["lengths"], grid["accuracy"])]
            lines += _table(rows) + [""]
        if name in report.get("figures", {}):
            lines += [f"![{name}]({report['figures'][name]})", ""]
    if not report.get("figures") and any(k in report["tasks"] for k in ("niah", "stability", "mqar")):
        lines += ["(figures need matplotlib, part of linmem's base install: `pip install matplotlib`)", ""]
    return "\n".join(lines)
