#!/usr/bin/env bash
# Study runs on a lent machine that is given back soon after each command returns (the H200 this project borrows):
# start a queue that outlives the command, watch its progress, and copy every finished run off the machine at the
# end of each watch, so that a machine taken back between two commands loses only the runs still training.
#
#   bash scripts/study/detached.sh start STUDY.yaml OUT JOBS MODEL:SEED [MODEL:SEED ...]
#       the queue of scripts/study/side_by_side.sh, in a new process session (setsid); returns at once
#   bash scripts/study/detached.sh watch SECONDS OUT [OUT ...]
#       every 60 s (WATCH_INTERVAL): each run's last update of its total (metrics.jsonl, config.yaml) with, while it
#       trains, about how many seconds to its last update at its last speed, whether it is evaluated (items.json),
#       the GPU's load; returns within 5 s (WATCH_CHECK) of every queue under the OUTs being done, or when SECONDS
#       have passed, and fails at once for an OUT whose queue was not started on this machine
#   bash scripts/study/detached.sh pack [--no-weights] DEST OUT [OUT ...]
#       one tar per evaluated run, DEST/STUDY-MODEL-seed-S.tar (config, metrics, eval JSON, items and, unless
#       --no-weights, the model's weights; never checkpoints), and DEST/STUDY-logs.tar (study.json, the logs)
#   bash scripts/study/detached.sh pieces DEST OUT MODEL:SEED [FIRST [COUNT]]
#       weights larger than a command may return: the run's model/model.safetensors cut into pieces of PIECE_BYTES
#       (16,000,000: a lent machine returns at most 16 MiB a file and 64 MiB a command), pieces FIRST (1) to
#       FIRST + COUNT - 1 (4) written to DEST as STUDY-MODEL-seed-S.safetensors.NNN-of-MMM, with the whole file's
#       sha256 beside them; prints how many pieces there are, for the commands that fetch the rest
#   bash scripts/study/detached.sh join MODEL_DIR FILE [FILE ...]
#       the pieces and their .sha256 (from any folders) put together as MODEL_DIR/model.safetensors, refused
#       unless every piece is there and the sha256 matches
#
# A command on the lent machine is then `watch 500 OUT; pack $OUT_DIR OUT`, repeated until the queue is done;
# `tar xf` of the tars beside the local study folder merges the runs, and `linmem study STUDY.yaml --out OUT
# --report-only` rebuilds the tables. A machine given back between two commands loses every run not yet packed, so
# size a queue for its runs to be evaluated inside a command that packs them (the watch's times to the last update,
# plus the evaluation, are the guide).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { sed -n '6,/^#$/p' "$0" | sed '$d' >&2; exit 2; }  # the verbs' lines: from line 6 to the first bare '#'
[ $# -ge 1 ] || usage
verb=$1; shift

field() {  # NAME LINE: a number from a metrics.jsonl line
  grep -o "\"$1\": [0-9.e+-]*" <<< "$2" | grep -o '[^ ]*$'
}

progress() {  # OUT: one line per run folder; while a run trains, the time to its last update at its last speed
  local run last step total tokens speed state
  for run in "$1"/runs/*/seed-*; do
    [ -d "$run" ] || continue
    last=$(tail -n 1 "$run/metrics.jsonl" 2>/dev/null)
    step=$(field step "$last")
    total=$(awk '/^train:/ {t = 1; next} /^[^ ]/ {t = 0} t && /^  steps:/ {print $2; exit}' "$run/config.yaml" \
            2>/dev/null)
    tokens=$(field tokens "$last") speed=$(field tokens_per_s "$last")
    if [ -f "$run/items.json" ]; then
      state=evaluated
    elif [ -n "$step" ] && [ -n "$total" ] && [ "$step" -ge "$total" ]; then
      state="update $step of $total, evaluating"
    elif [ -n "$step" ] && [ -n "$total" ] && [ -n "$tokens" ] && [ -n "$speed" ]; then
      state="update $step of $total, about $(awk -v s="$step" -v n="$total" -v t="$tokens" -v v="$speed" \
              'BEGIN {printf "%d", (n - s) * t / s / v + 0.5}') s to the last update"
    else
      state="update ${step:-0}${total:+ of $total}"
    fi
    echo "  ${run#"$1"/runs/}: $state"
  done
}

case $verb in
  start)
    [ $# -ge 4 ] || usage
    out=$2
    mkdir -p "$out-logs"
    # said in the queue's log before the queue starts, so that a watch from now on does not take an earlier queue's
    # "queue done" for this one's
    echo "$(date -u +%FT%TZ) queued ${*:4}" >> "$out-logs/queue.log"
    setsid nohup bash "$here/side_by_side.sh" "$@" > "$out-queue.out" 2>&1 < /dev/null &
    echo "queue started (pid $!): $*"
    ;;
  watch)
    [ $# -ge 2 ] || usage
    seconds=$1; shift
    for out in "$@"; do
      # a queue that was never started here (a fresh machine, after the last one was given back with its runs)
      # is said at once, not watched for SECONDS
      [ -f "$out-queue.out" ] || [ -f "$out-logs/queue.log" ] || {
        echo "no queue for $out on this machine: none was started here (a new machine loses the runs of the last)" >&2
        exit 1
      }
    done
    # the queues' end is checked every WATCH_CHECK (5) seconds and the progress printed every WATCH_INTERVAL (60)
    # and once at the end: a watch returns within seconds of the last run's end, whatever the interval, so that the
    # pack after it fits in the command that ran the queue
    end=$(( $(date +%s) + seconds )) report=0
    while :; do
      now=$(date +%s) all_done=1
      for out in "$@"; do
        # a folder's log holds every queue started on it: done when its last line says so and, from the first
        # queue `start` put in it on, as many queues have ended as were started (side by side, they end in turn)
        awk '/ queued / {q++} q && / queue done$/ {d++} {last = $0}
             END {exit !(last ~ / queue done$/ && d >= q)}' "$out-logs/queue.log" 2>/dev/null || all_done=0
      done
      if [ $all_done = 1 ] || [ "$now" -ge "$report" ] || [ "$now" -ge "$end" ]; then
        echo "$(date -u +%T)"
        for out in "$@"; do
          echo "$out"
          progress "$out"
          grep -h " rc [1-9]" "$out-logs/queue.log" 2>/dev/null | sed 's/^/  failed: /'
        done
        command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
        report=$(( now + ${WATCH_INTERVAL:-60} ))
      fi
      [ $all_done = 1 ] && break
      [ "$now" -ge "$end" ] && break
      check=${WATCH_CHECK:-5} left=$(( end - now ))
      sleep $(( left < check ? left : check ))
    done
    ;;
  pack)
    weights=1
    [ "${1:-}" = --no-weights ] && { weights=0; shift; }
    [ $# -ge 2 ] || usage
    dest=$(realpath -m "$1"); shift
    mkdir -p "$dest"
    runs=0
    for out in "$@"; do
      [ -d "$out" ] || { echo "no study folder $out on this machine: nothing to pack" >&2; exit 1; }
      parent=$(realpath "$(dirname "$out")") name=$(basename "$out")
      excludes=(--exclude=checkpoints)
      [ $weights = 0 ] && excludes+=(--exclude='*.safetensors')
      for run in "$out"/runs/*/seed-*; do
        [ -f "$run/items.json" ] || continue
        model=$(basename "$(dirname "$run")") seed=$(basename "$run")
        tar cf "$dest/$name-$model-$seed.tar" "${excludes[@]}" -C "$parent" "$name/runs/$model/$seed" && runs=$((runs + 1))
      done
      records=()
      [ -f "$out/study.json" ] && records+=("$name/study.json")
      [ -d "$out-logs" ] && records+=("$name-logs")
      [ ${#records[@]} -gt 0 ] && tar cf "$dest/$name-logs.tar" -C "$parent" "${records[@]}"
    done
    echo "packed $runs evaluated run(s) into $dest"
    ;;
  pieces)
    [ $# -ge 3 ] || usage
    dest=$(realpath -m "$1") out=$2 model=${3%%:*} seed=${3##*:} first=${4:-1} count=${5:-4}
    size=${PIECE_BYTES:-16000000}
    file="$out/runs/$model/seed-$seed/model/model.safetensors"
    [ -f "$file" ] || { echo "no weights at $file" >&2; exit 1; }
    base="$(basename "$out")-$model-seed-$seed.safetensors"
    total=$(( ($(stat -c %s "$file") + size - 1) / size ))
    mkdir -p "$dest"
    (cd "$(dirname "$file")" && sha256sum model.safetensors) > "$dest/$base.sha256"
    last=$(( first + count - 1 < total ? first + count - 1 : total ))
    for ((i = first; i <= last; i++)); do
      piece=$(printf "%s.%03d-of-%03d" "$base" "$i" "$total")
      dd if="$file" of="$dest/$piece" bs="$size" skip=$((i - 1)) count=1 status=none || exit 1
    done
    echo "$base: $total pieces of $size bytes; wrote pieces $first to $last into $dest"
    ;;
  join)
    [ $# -ge 2 ] || usage
    target=$1; shift
    sums=() pieces=()
    for f in "$@"; do
      case $f in *.sha256) sums+=("$f") ;; *) pieces+=("$f") ;; esac
    done
    [ ${#sums[@]} -ge 1 ] || { echo "join: no .sha256 among the files" >&2; exit 1; }
    [ ${#pieces[@]} -ge 1 ] || { echo "join: no pieces among the files" >&2; exit 1; }
    want=$(awk '{print $1}' "${sums[0]}")
    total=${pieces[0]##*-of-}
    declare -A by_index=()
    for f in "${pieces[@]}"; do
      suffix=${f##*.safetensors.} index=$((10#${suffix%%-of-*}))
      [ "${suffix##*-of-}" = "$total" ] || { echo "join: $f belongs to a cut into ${suffix##*-of-} pieces, not $total" >&2; exit 1; }
      by_index[$index]=$f
    done
    mkdir -p "$target"
    tmp=$(mktemp "$target/.model.safetensors.XXXXXX")
    for ((i = 1; i <= 10#$total; i++)); do
      [ -n "${by_index[$i]:-}" ] || { rm -f "$tmp"; echo "join: piece $i of $total is missing" >&2; exit 1; }
      cat "${by_index[$i]}" >> "$tmp"
    done
    got=$(sha256sum "$tmp" | awk '{print $1}')
    [ "$got" = "$want" ] || { rm -f "$tmp"; echo "join: sha256 $got is not the recorded $want" >&2; exit 1; }
    mv "$tmp" "$target/model.safetensors"
    echo "joined $((10#$total)) pieces into $target/model.safetensors (sha256 checked)"
    ;;
  *) usage ;;
esac
