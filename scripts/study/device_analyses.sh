#!/usr/bin/env bash
# The analyses of a study's evaluated runs that need their weights, run where the weights are: on a lent machine
# whose commands return at most 64 MiB, a 32M-parameter run's weights (129 MB) cannot come back in one command, but
# what is measured on them can. For each MODEL:SEED of the study folder OUT:
#   recall-FORMAT/   `linmem eval --tasks recall` in a second format (FORMAT, default keeps/roles/materials: held out
#                    of training like the study's test format) with every other recall setting of the study's own
#                    evaluation (OUT/study.json), so that the two formats are measured alike
#   prior.json       scripts/recall/value_prior.py: the language's guess at both formats' values, no fact in context
#   probe/           `linmem probe` with PROBE_OPTIONS (default: --keys roles --sources shakespeare)
# each step's output in steps.log; one tar per run, DEST/STUDY-MODEL-seed-S-analyses.tar. A step that fails or
# runs past STEP_SECONDS (default 300) is logged and the next one runs. The probe's filler text is read first: a
# machine that cannot read it stops before any step.
#
#   bash scripts/study/device_analyses.sh DEST OUT MODEL:SEED [MODEL:SEED ...]
#   DEVICE (default cuda), FORMAT, PROBE_OPTIONS, STEP_SECONDS, PYTHON (default python3) may be set.
set -uo pipefail
[ $# -ge 3 ] || { sed -n 2,15p "$0" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
dest=$(realpath -m "$1") out=$2
shift 2
python=${PYTHON:-python3} device=${DEVICE:-cuda} format=${FORMAT:-keeps/roles/materials}
probe_options=${PROBE_OPTIONS:---keys roles --sources shakespeare} step_seconds=${STEP_SECONDS:-300}
[ -f "$out/study.json" ] || { echo "no study record at $out/study.json" >&2; exit 1; }
IFS=/ read -r template keys values <<< "$format"
# the study's own recall settings and its test format, from its record (a setting it does not record: linmem
# eval's default, which is what the study used)
read -r split batch items filler bindings test_format < <("$python" - "$out/study.json" <<'EOF'
import dataclasses, json, sys
from linmem.eval.runner import EvalOptions
o = {**dataclasses.asdict(EvalOptions()), **json.load(open(sys.argv[1]))["eval"]["options"]}
print(o["split"], o["batch_size"], o["recall_items"], o["recall_filler"], ",".join(map(str, o["recall_bindings"])),
      f"{o['recall_template']}/{o['recall_keys']}/{o['recall_values']}")
EOF
)
[ -n "${test_format:-}" ] || { echo "no recall settings in $out/study.json" >&2; exit 1; }
# the probe's filler text, read once before any step: a machine that lacks it (a built-in source's pip package, a
# path) says so now, not after the recall and prior steps of every run
# shellcheck disable=SC2086  # PROBE_OPTIONS holds several words on purpose
"$python" - $probe_options <<'EOF' || exit 1
import sys
from linmem.cli import build_parser
from linmem.data.builtin import open_source
from linmem.memory.commands import documents_and_label
args = build_parser("probe").parse_args(["probe", "MODEL_DIR", *sys.argv[1:]])
try:
    for spec in args.sources or []:
        next(iter(open_source(spec).documents()), None)
    if not args.sources:
        documents_and_label(None)
except (OSError, ValueError) as e:
    sys.exit(f"the probe's filler text cannot be read here (PROBE_OPTIONS: {' '.join(sys.argv[1:])}): {e}")
EOF
mkdir -p "$dest"
name=$(basename "$out")

step() {  # LABEL COMMAND...: run with a time limit, its output in the run's steps.log
  local label=$1 rc; shift
  echo "== $label: $*" >> "$work/steps.log"
  timeout "$step_seconds" "$@" >> "$work/steps.log" 2>&1
  rc=$?
  echo "== $label: rc $rc" >> "$work/steps.log"
  echo "  $label: rc $rc"
}

for pair in "$@"; do
  model=${pair%%:*} seed=${pair##*:}
  [ "$model" != "$pair" ] || { echo "not MODEL:SEED: $pair" >&2; exit 2; }
  run="$out/runs/$model/seed-$seed"
  [ -f "$run/items.json" ] || { echo "$model seed $seed: not evaluated, skipped"; continue; }
  work=$(mktemp -d)
  echo "$model seed $seed"
  step "recall $format" "$python" -m linmem.cli eval "$run/model" --tasks recall --split "$split" \
      --batch-size "$batch" --recall-items "$items" --recall-filler "$filler" --recall-bindings "$bindings" \
      --recall-template "$template" --recall-keys "$keys" --recall-values "$values" --device "$device" \
      --out "$work/recall-$template-$keys-$values"
  step "value prior" "$python" "$here/../recall/value_prior.py" "$work/prior.json" --models "$run/model" \
      --formats "$test_format" "$format" --device "$device"
  # shellcheck disable=SC2086  # PROBE_OPTIONS holds several words on purpose
  step probe "$python" -m linmem.cli probe "$run/model" $probe_options --device "$device" --out "$work/probe"
  tar cf "$dest/$name-$model-seed-$seed-analyses.tar" -C "$work" . && rm -rf "$work"
done
echo "analyses in $dest"
