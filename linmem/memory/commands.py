"""``linmem probe MODEL_DIR``: the memory lab's default protocol on a model folder, as ``report.html`` and
``results.json``.

Only argparse and the standard library load with this module (the experiment names from
``linmem.memory.experiment_names``, the backend names from ``linmem.io.backend_names``); ``main`` imports the lab,
so that the help and argument errors answer at once."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from linmem.io.backend_names import add_backend_option
from linmem.memory.experiment_names import CLEAN_RECALL_GATE, EXPERIMENTS

DEFAULT_SOURCES = ("shakespeare", "bible-kjv", "stdlib")
REPORT_FILES = ("report.html", "results.json")  # what the probe writes into its output folder


def tokens_after(text: str) -> int:
    """``--write-tokens-after``'s value: a whole number >= 0 (argparse says the error)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {value}")
    return value


def positive(text: str) -> int:
    """``--chunk``'s value: a whole number >= 1 (argparse says the error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a linmem, FLA or Hugging Face hybrid model folder with tokenizer.json, "
                        "zoo:NAME or a Hugging Face model id ORG/NAME[@REVISION] (fetched into the Hugging Face cache)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: MODEL_DIR/probe; required for zoo:NAME and Hub models)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output folder that linmem probe did not make (its other files "
                             "are kept)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    add_backend_option(parser)
    parser.add_argument("--sources", nargs="+", default=None,
                        help=f"text sources for the filler: built-in names or paths (default: the first of "
                             f"{', '.join(DEFAULT_SOURCES)} that is installed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--filler", type=int, default=512, help="filler tokens per prompt")
    parser.add_argument("--bindings", type=int, default=4, help="key-value bindings per prompt (K)")
    parser.add_argument("--repeats", type=int, default=3, help="presentations of each binding (R)")
    parser.add_argument("--dev-sources", type=int, default=16)
    parser.add_argument("--confirm-sources", type=int, default=16)
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 2, 4, 8], help="bindings per prompt to sweep")
    parser.add_argument("--gaps", type=int, nargs="+", default=[0, 128, 256], help="query gaps (tokens) to sweep")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the load and gap sweeps")
    parser.add_argument("--no-extras", action="store_true",
                        help="skip write reach, write-key overlap, logit lens, neutral suppression, joint top-k, "
                             "write/read scans")
    parser.add_argument("--only", nargs="+", default=(), metavar="EXPERIMENT", choices=EXPERIMENTS,
                        help=f"run only these experiments (one of: {', '.join(EXPERIMENTS)}); the head scan "
                             f"runs too when one needs the frozen component and --component is not given")
    parser.add_argument("--template", default="code",
                        help="fact wording: a name (code, lives, colon, likes; held out of training: went, keeps), a "
                             "file whose first line is like 'The code of {key} is {value}.', or that text itself")
    parser.add_argument("--keys", default=None,
                        help="key words: a name (names, letters, objects; held out: roles) or a file of words "
                             "(default: chosen automatically, said in the report)")
    parser.add_argument("--values", default=None,
                        help="value words: a name (colors, cities, animals, numbers, shapes; held out: directions, "
                             "materials) or a file of words (default: chosen automatically, said in the report)")
    parser.add_argument("--transfer-values", default=None,
                        help="subspace transfer across vocabularies (App. D.2's colours -> shapes): the rank-k basis "
                             "is learned on --values facts and tested on facts whose values are these words (a name "
                             "or a file, as --values); default: tested on --values facts too")
    parser.add_argument("--component", default=None,
                        help="use this component (like L3H1S or L3H1R) instead of the head scan's choice")
    parser.add_argument("--write-tokens-after", type=tokens_after, default=0, metavar="D",
                        help="the lifecycle's write block and donor write, the head interaction's blocks and the "
                             "write/read Spearman's writes cover each fact and the D tokens after it (default 0: "
                             "the fact's own tokens, as in the paper); for a model whose write_reach shows it "
                             "writes a fact just after it")
    parser.add_argument("--chunk", type=positive, default=None, metavar="N",
                        help="edit sets (in the head scan: heads) per batched run (default: as many as the device's "
                             "free memory holds, measured on a first batch; a CPU takes 16); halved on an "
                             "out-of-memory error either way")
    parser.add_argument("--min-clean-recall", type=float, default=CLEAN_RECALL_GATE,
                        help="attribute only if clean recall (4 candidates, chance 0.25) reaches this on both source "
                             "sets; below it the report says so and skips the attributions (0: no gate)")
    parser.set_defaults(func=main)


def documents(specs):
    """The filler documents: those of ``specs`` (built-in names or paths), else the first installed of
    ``DEFAULT_SOURCES`` (``documents_and_label`` also says which)."""
    return documents_and_label(specs)[0]


def documents_and_label(specs):
    """``(documents, label)``; the label names the sources and, for the default, which were not installed, so that a
    report from a machine without ``shakespeare`` says that its filler is another text."""
    from linmem.data.builtin import open_source
    from linmem.data.sources import SourceUnavailable

    if specs:
        return itertools.chain.from_iterable([readable_documents(s) for s in specs]), ", ".join(specs)
    missing = []
    for name in DEFAULT_SOURCES:
        try:
            source = open_source(name)
            docs = list(itertools.islice(source.documents(), 400))
        except SourceUnavailable:
            missing.append(name)
            continue
        return docs, f"{name} (default" + (f"; not installed: {', '.join(missing)})" if missing else ")")
    raise ValueError("no default text source is installed; pass --sources PATH")


def readable_documents(spec):
    """The documents of the source ``spec`` with its first one already read, so that a source that is missing,
    not installed or empty fails here (``FileNotFoundError`` / ``ValueError``), before a model is loaded; the rest
    are read as the probe asks for them."""
    from linmem.data.builtin import open_source

    documents = iter(open_source(spec).documents())
    first = next(documents, None)
    if first is None:
        raise ValueError(f"text source {spec!r} holds no documents: the probe needs filler text")
    return itertools.chain([first], documents)


def main(args: argparse.Namespace) -> int:
    from linmem.io.folders import check_output_folder, output_folder
    from linmem.io.models import default_output_folder, resolve_model_folder

    # before torch loads and before any work: an unreadable filler source, a missing model folder, an unknown
    # zoo:NAME or Hub id, and an output folder that would be refused (MODEL_DIR/probe by default; for a shipped model,
    # inside the package, and a Hub model, in the Hugging Face cache, --out is required)
    docs, filler = documents_and_label(args.sources)
    model_folder = resolve_model_folder(args.model_dir, check_hub_config)
    out = Path(args.out) if args.out else default_output_folder(model_folder, "probe")
    check_output_folder(out, overwrite=args.overwrite, kind="probe", files=REPORT_FILES)
    with output_folder(out, overwrite=args.overwrite, kind="probe"):  # a failed probe leaves no folder behind
        summary = probe(args, docs, filler, out, model_folder)
    recall = summary["clean_recall"]
    if any(not recall[split] >= args.min_clean_recall for split in ("development", "confirmation")):
        print(f"clean recall too low to attribute anything (development {recall['development']:.3f}, confirmation "
              f"{recall['confirmation']:.3f}, gate {args.min_clean_recall:g}): attributions skipped")
    chosen = summary["head_scan"]["chosen"] if "head_scan" in summary else args.component
    if chosen:
        print(f"component: {chosen}")
    print(f"wrote {out / 'report.html'} and {out / 'results.json'}")
    return 0


def probe(args: argparse.Namespace, docs, filler: str, out: Path, model_folder: Path) -> dict:
    """Load the model of ``model_folder`` (what ``args.model_dir`` resolved to) and run the protocol into ``out``;
    returns the protocol's summary."""
    from linmem.memory.probe import ProbeOptions, load_model_dir, run_protocol

    model, tokenizer = load_model_dir(model_folder, args.device, args.backend)
    options = ProbeOptions(args.dev_sources, args.confirm_sources, args.filler, args.bindings, args.repeats,
                           args.seed, tuple(args.loads), tuple(args.gaps), sweeps=not args.no_sweeps,
                           extras=not args.no_extras, only=tuple(args.only), component=args.component,
                           min_clean_recall=args.min_clean_recall, template=args.template, keys=args.keys,
                           values=args.values, transfer_values=args.transfer_values,
                           write_tokens_after=args.write_tokens_after, chunk=args.chunk)
    print(f"filler text: {filler}")
    return run_protocol(model, tokenizer, docs, options, out,
                        header={"model": str(args.model_dir), **loaded_from(args.model_dir, model_folder),
                                "device": str(next(model.parameters()).device), "filler_text": filler})


def loaded_from(name: str, model_folder: Path) -> dict[str, str]:
    """``{"model_folder": ...}`` where the model argument ``name`` stands for another folder (a run folder's
    checkpoint, a shipped model, a Hub model's snapshot, whose folder name is its commit), else nothing."""
    return {} if Path(name) == Path(model_folder) else {"model_folder": str(model_folder)}


def check_hub_config(folder: Path, name: str) -> None:
    """``linmem.models.loading.check_hub_config``, imported (with torch) only when a Hub model is named."""
    from linmem.models.loading import check_hub_config as check

    check(folder, name)
