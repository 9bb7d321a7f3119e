#!/usr/bin/env bash
# Train every config of a sweep folder side by side for SECONDS, then print the recall report.
#   bash scripts/zoo/recall-sweep/sweep.sh CONFIGS_DIR OUT_DIR SECONDS
set -u
configs=${1:?usage: sweep.sh CONFIGS_DIR OUT_DIR SECONDS}; out=${2:?}; seconds=${3:?}
python=${PYTHON:-python3}
mkdir -p "$out"
for f in "$configs"/*.yaml; do
  n=$(basename "$f" .yaml)
  timeout -s TERM -k 30 "$seconds" "$python" -m linmem.cli train "$f" --out "$out/$n" --no-progress >"$out/$n.log" 2>&1 &
done
wait
"$python" "$(dirname "$0")/report.py" "$out"
