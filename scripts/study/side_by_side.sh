#!/usr/bin/env bash
# Run (model, seed) pairs of one study side by side on one machine: a queue of `linmem study --only MODEL --seeds S`
# processes, at most JOBS at a time, all writing into the same study folder. Small models leave most of a big GPU
# idle, so several runs at once finish far sooner than one after the other; each run is still the study's own
# recipe (`linmem study` checks it), and a run cut short resumes when the same pair is given again.
#
#   bash scripts/study/side_by_side.sh STUDY.yaml OUT JOBS MODEL:SEED [MODEL:SEED ...]
#   e.g. bash scripts/study/side_by_side.sh configs/study/rla-paper.yaml runs/study/rla-paper 10 rdn:0 gdn:0 rdn:1
#
# STUDY_OPTIONS (optional) is passed to every `linmem study` process, e.g. STUDY_OPTIONS="--set train.compile=true"
# (only settings that change no update are accepted).
# Logs (beside the study folder, which holds only linmem's files): OUT-logs/MODEL-seed-S.log, and OUT-logs/queue.log
# says when each run started and ended, with its exit code.
# The tables are rebuilt afterwards with `linmem study STUDY.yaml --out OUT --report-only`.
set -uo pipefail
[ $# -ge 4 ] || { sed -n 2,14p "$0" >&2; exit 2; }
study=$1 out=$2 jobs=$3
shift 3
logs="$out-logs"
mkdir -p "$logs"
queue_log="$logs/queue.log"
python="${PYTHON:-python3}"

run_pair() {  # MODEL SEED
  local log="$logs/$1-seed-$2.log" rc
  echo "$(date -u +%FT%TZ) start $1 seed $2" >> "$queue_log"
  # shellcheck disable=SC2086  # STUDY_OPTIONS holds several words on purpose
  OMP_NUM_THREADS=1 "$python" -m linmem.cli study "$study" --out "$out" --only "$1" --seeds "$2" --no-figures \
      --no-progress ${STUDY_OPTIONS:-} > "$log" 2>&1
  rc=$?
  echo "$(date -u +%FT%TZ) end $1 seed $2 rc $rc" >> "$queue_log"
}

first=1
for pair in "$@"; do
  model=${pair%%:*} seed=${pair##*:}
  [ "$model" != "$pair" ] || { echo "not MODEL:SEED: $pair" >&2; exit 2; }
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  run_pair "$model" "$seed" &
  # the first process creates the study folder and its record; the others start once it exists
  if [ $first = 1 ]; then
    first=0
    for _ in $(seq 120); do { [ -f "$out/study.json" ] || [ -z "$(jobs -rp)" ]; } && break; sleep 1; done
  fi
done
wait
echo "$(date -u +%FT%TZ) queue done" >> "$queue_log"
