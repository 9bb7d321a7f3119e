"""``linmem eval MODEL_DIR --tasks ppl,cloze,mqar,niah,recall,stability [--data DIR] [--backend NAME]``: a wrapper
of ``evaluate``.

Only argparse and the standard library load with this module (the task names from ``linmem.eval.task_names``, the
backend names from ``linmem.io.backend_names``);
``run`` imports the evaluation, so that the help and argument errors answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from linmem.eval.task_names import TASKS, parse_max_tokens, parse_tasks
from linmem.io.backend_names import add_backend_option


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _token_count(text: str) -> int:
    try:
        return parse_max_tokens(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a model folder (OUT/model of linmem train, or a checkpoint), zoo:NAME or a "
                        "Hugging Face model id ORG/NAME[@REVISION] (fetched into the Hugging Face cache)")
    parser.add_argument("--tasks", default="ppl,cloze,mqar,niah,recall,stability",
                        help=f"comma-separated from {', '.join(TASKS)}, or all")
    parser.add_argument("--data", default=None, help="dataset folder for held-out text (default: the training one)")
    parser.add_argument("--split", default="test", help="held-out split (test)")
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default MODEL_DIR/eval; required for zoo:NAME and Hub models)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output folder that linmem eval did not make (its other files are "
                             "kept)")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the training length)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=_token_count, default=262_144,
                        help="held-out tokens for perplexity, or all (the whole split)")
    parser.add_argument("--cloze-examples", type=int, default=500)
    parser.add_argument("--mqar-pairs", type=_ints, default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--mqar-samples", type=int, default=64)
    parser.add_argument("--niah-lengths", type=_ints, default=[256, 512, 1024, 2048])
    parser.add_argument("--niah-depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--niah-samples", type=int, default=20)
    parser.add_argument("--stability-windows", type=int, default=16)
    parser.add_argument("--recall-items", type=int, default=64, help="memory-lab recall items")
    parser.add_argument("--recall-filler", type=int, default=256, help="filler tokens per memory-lab item")
    parser.add_argument("--recall-template", default="code",
                        help="memory-lab fact template: a name of linmem.memory.fact_formats.TEMPLATES, a file or a "
                             "text with {key} and {value} (code)")
    parser.add_argument("--recall-keys", default="names", help="key vocabulary: a name of KEY_WORDS or a word file "
                        "(names)")
    parser.add_argument("--recall-values", default="colors", help="value vocabulary: a name of VALUE_WORDS or a "
                        "word file (colors)")
    parser.add_argument("--recall-bindings", type=_ints, default=[4],
                        help="comma-separated loads (facts per item), each measured on --recall-items items (4); a "
                             "load the tokenizer has too few single-token keys for is refused")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    add_backend_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from linmem.eval.plots import report_files
    from linmem.io.folders import check_output_folder, output_folder
    from linmem.io.models import default_output_folder, resolve_model_folder

    tasks = parse_tasks(args.tasks)
    # before torch loads: a missing model folder, an unknown zoo:NAME or Hub id, and an output folder that would be
    # refused (a Hub model's config is checked before its weights are fetched)
    model = resolve_model_folder(args.model_dir, check_hub_config)
    named = Path(args.model_dir)
    out = args.out or (named / "eval" if named.is_dir() else default_output_folder(model, "eval"))
    check_output_folder(out, overwrite=args.overwrite, kind="eval", files=report_files(tasks))
    from linmem.eval.descriptions import describe_perplexity
    from linmem.eval.runner import EvalOptions, evaluate

    options = EvalOptions(data=args.data, split=args.split, seq_len=args.seq_len, batch_size=args.batch_size,
                          max_tokens=args.max_tokens, cloze_examples=args.cloze_examples, mqar_pairs=args.mqar_pairs,
                          mqar_samples=args.mqar_samples, niah_lengths=args.niah_lengths,
                          niah_depths=args.niah_depths, niah_samples=args.niah_samples,
                          stability_windows=args.stability_windows, recall_items=args.recall_items,
                          recall_filler=args.recall_filler, recall_template=args.recall_template,
                          recall_keys=args.recall_keys, recall_values=args.recall_values,
                          recall_bindings=args.recall_bindings, seed=args.seed, device=args.device)
    with output_folder(out, overwrite=args.overwrite, kind="eval"):  # a failed evaluation leaves no folder behind
        report = evaluate(model, tasks, options, out, backend=args.backend)  # the folder resolved above, fetched once
    for name, result in report["tasks"].items():
        if result.get("available") is False:
            print(f"{name}: {result['reason']}")
        elif name == "ppl":
            print(f"ppl: {result['metrics']['split']} ppl {describe_perplexity(result['metrics'])}, "
                  f"loss {result['metrics']['loss']:.4g}")
        else:
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in result["metrics"].items())
            print(f"{name}: {shown}")
    print(f"report: {out / 'results.md'}")
    return 0


def check_hub_config(folder: Path, name: str) -> None:
    """``linmem.models.loading.check_hub_config``, imported (with torch) only when a Hub model is named."""
    from linmem.models.loading import check_hub_config as check

    check(folder, name)
