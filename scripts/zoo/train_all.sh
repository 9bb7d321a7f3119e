#!/usr/bin/env bash
# Train zoo configs side by side on one machine: one `linmem train` process per config, all at once (these models
# are far too small to fill a GPU alone). Each run resumes from its newest checkpoint, so calling this again after
# a stop continues every unfinished run.
#
#   scripts/zoo/train_all.sh OUT_ROOT [SECONDS] [NAME ...]
#
# OUT_ROOT/NAME is the run folder of configs/zoo/NAME.yaml and OUT_ROOT/NAME.log its output. SECONDS (0: no
# limit) sends SIGTERM to every run still going after that long: each stops after its current update with a
# checkpoint (`--resume` loses nothing). NAMEs default to every config in configs/zoo.
set -u
root=${1:?usage: scripts/zoo/train_all.sh OUT_ROOT [SECONDS] [NAME ...]}
seconds=${2:-0}
shift $(( $# >= 2 ? 2 : $# ))
here=$(cd "$(dirname "$0")" && pwd)
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in "$here"/*.yaml; do names+=("$(basename "$f" .yaml)"); done
fi
python=${PYTHON:-python3}
mkdir -p "$root"
pids=()
for name in "${names[@]}"; do
  [ -f "$here/$name.yaml" ] || { echo "no config $here/$name.yaml" >&2; exit 2; }
  if [ -f "$root/$name/model/train_info.json" ]; then echo "$name: already trained"; continue; fi
  if [ "$seconds" -gt 0 ]; then limit=(timeout -s TERM -k 60 "$seconds"); else limit=(); fi
  "${limit[@]}" "$python" -m linmem.cli train "$here/$name.yaml" --out "$root/$name" --resume --no-progress \
    >>"$root/$name.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for name in "${names[@]}"; do
  if [ -f "$root/$name/model/train_info.json" ]; then echo "$name: done"; else echo "$name: unfinished ($(tail -n 1 "$root/$name.log"))"; fi
done
exit $status
