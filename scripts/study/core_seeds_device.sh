#!/usr/bin/env bash
# The core-seeds studies (configs/study/core-seeds*.yaml) on the lent GPU, whose working-tree copy holds at most
# 64 MiB (the checkout's tracked files are about 110 MiB: the shipped zoo's weights, 66 MiB, and the studies' record
# archives docs/study/*/runs-NN.tar.xz, 26 MiB) and is sent afresh with every command. The runs use a copy of their own,
# so that neither that limit nor uncommitted edits in the checkout reach them:
#
#   here:   bash scripts/study/core_seeds_device.sh prepare
#       .devrun/w (ignored): the committed linmem (HEAD, without the zoo's weights), configs and scripts, this
#       checkout's core-seeds files over them, data/zoo-4k (build it first: docs/study/core-seeds-lr/README.md) and
#       each core-seeds study's queue.log so far (the machine's queues append to it)
#   here:   bash scripts/study/core_seeds_device.sh park
#       moves the shipped zoo's weights and the studies' record archives out of the checkout and puts them back in
#       the background once the device tool has read .devrun/sent (30 s later), or after PARK_SECONDS (600) at most;
#       a `run` call naming .devrun in carry must follow at once (tests that load the zoo fail here in between). It
#       prints the size the tool will send (tracked files present, and .devrun) and warns above 60 MiB (the tool
#       takes 64 by its own count). Every call sends the tree again, a second `collect` on the held machine too:
#       park again before each call
#   here:   bash scripts/study/core_seeds_device.sh restore
#       puts the parked files back at once (after a call the tool answered without sending the tree)
#   device: bash .devrun/w/scripts/study/core_seeds_device.sh start STUDY.yaml MODEL:SEED [MODEL:SEED ...]
#       copies .devrun/w to /root/w (once a machine) and starts scripts/study/detached.sh's queue there, every
#       pair at once; the study folder is /root/w/runs/study/NAME
#   device: bash .devrun/w/scripts/study/core_seeds_device.sh collect SECONDS NAME
#       watches the queue up to SECONDS, then packs every evaluated run (records, no weights) and the logs into
#       $OUT/NAME-runs.tar.gz; repeat until the queue is done (a machine given back loses the runs not packed)
#   device: bash .devrun/w/scripts/study/core_seeds_device.sh race-then-seeds SECONDS SIZE
#       watches the race's queue (core-seeds-lr) up to SECONDS; once every run of it is evaluated, decides the races
#       on its runs and the shipped tables (rate_race.py --write, the rule unchanged; $OUT/race-next.txt), sets the
#       rates just decided in the machine's core-seeds.yaml and starts core-seeds' first queue of those models' runs
#       (at most SIZE), so that one held machine goes from a race to its runs; `collect` both studies after it
#
# Here, `tar xzf NAME-runs.tar.gz -C DIR` then `tar xf` of each tar in DIR inside runs/study merges the runs, and
# `python scripts/study/run_archive.py pack NAME` adds them to the shipped records as the next part.
# Triton's compiled kernels travel between machines: `start` unpacks .devrun/triton-cache.tgz (when carried) into
# the runs' TRITON_CACHE_DIR, so that the queue's runs do not each compile the same kernels first, and `collect`
# returns the cache as $OUT/triton-cache.tgz (under 15 MiB); copy it to .devrun/triton-cache.tgz here.
set -uo pipefail
usage() { sed -n 2,29p "$0" >&2; exit 2; }  # the header above
verb=${1:-}
shift || true
root=$(cd "$(dirname "$0")/../.." && pwd)
self=$root/scripts/study/$(basename "$0")
parked=/tmp/core-seeds-parked-weights
zoo=linmem/zoo/models
parked_models=($(cd "$root/$zoo" 2>/dev/null && for f in */model.safetensors; do [ -f "$f" ] && dirname "$f"; done))  # every zoo model here
send_limit=$((60 * 1024 * 1024))  # the tool takes 64 MiB by its own count, and has refused 63.4 by this one

case $verb in
  prepare)
    cd "$root" || exit 1
    [ -f data/zoo-4k/index.json ] || {
      echo "no data/zoo-4k here: build it first (docs/study/core-seeds-lr/README.md)" >&2; exit 1; }
    rm -rf .devrun/w && mkdir -p .devrun/w
    git archive HEAD linmem configs scripts ":!$zoo" | tar xf - -C .devrun/w || exit 1
    cp configs/study/core-seeds*.yaml .devrun/w/configs/study/ && cp "$0" .devrun/w/scripts/study/
    mkdir -p .devrun/w/data && cp -r data/zoo-4k .devrun/w/data/
    # the race's tables so far, which race-then-seeds reads beside the machine's new runs
    mkdir -p .devrun/w/docs/study/core-seeds-lr && cp docs/study/core-seeds-lr/results.json .devrun/w/docs/study/core-seeds-lr/
    # each study's queue log so far (here, or in its records), so that the machine's queues append to it and the
    # log `collect` returns holds every queue, not the machine's alone
    for name in core-seeds-lr core-seeds; do
      log=runs/study/$name-logs/queue.log
      mkdir -p ".devrun/w/runs/study/$name-logs"
      if [ -f "$log" ]; then
        cp "$log" ".devrun/w/$log"
      else  # the parts in order: a later part's log is the longer one
        for part in $(ls docs/study/$name/runs-*.tar.xz 2>/dev/null | sort); do
          tar xJf "$part" -C .devrun/w/runs/study "$name-logs/queue.log" 2>/dev/null || true
        done
      fi
    done
    du -sh .devrun
    ;;
  park)
    cd "$root" || exit 1
    mkdir -p "$parked" .devrun
    # an earlier park's restorer still waiting (its call was answered without sending the tree) would put the files
    # back in the middle of this call's send: stop it first, if that pid is still a restorer of this script (a pid
    # left from a restorer that has finished may belong to another process by now)
    if [ -f "$parked/restorer.pid" ]; then
      old=$(cat "$parked/restorer.pid")
      cat "/proc/$old/cmdline" 2>/dev/null | tr '\0' ' ' | grep -q "$(basename "$0")\" restore" && kill "$old"
      rm -f "$parked/restorer.pid"
    fi
    for name in "${parked_models[@]}"; do
      [ -f "$zoo/$name/model.safetensors" ] && mv "$zoo/$name/model.safetensors" "$parked/$name.safetensors"
    done
    # the record archives: `prepare` has taken what the machine needs of them (the queue logs) into .devrun/w
    mkdir -p "$parked/archives"
    for archive in docs/study/*/runs-*.tar.xz; do
      [ -f "$archive" ] || continue
      mkdir -p "$parked/archives/$(basename "$(dirname "$archive")")"
      mv "$archive" "$parked/archives/$(basename "$(dirname "$archive")")/"
    done
    # the sentinel's access time, set an hour back, moves once the tool reads it (relatime updates an access time
    # older than the modification time; the tool's copy has also been seen to leave it equal to the modification
    # time): any move means the tool is sending
    echo sent > .devrun/sent && touch -a -d '1 hour ago' .devrun/sent
    unread=$(stat -c %X .devrun/sent)
    setsid nohup bash -c '
      end=$(( $(date +%s) + ${PARK_SECONDS:-600} ))
      while [ "$(date +%s)" -lt "$end" ] && [ "$(stat -c %X .devrun/sent)" = "'"$unread"'" ]; do
        sleep 1
      done
      [ "$(date +%s)" -lt "$end" ] && sleep 30
      bash "'"$self"'" restore' > /dev/null 2>&1 < /dev/null &
    echo $! > "$parked/restorer.pid"
    echo "parked ${parked_models[*]}; restorer pid $!"
    tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    devrun=$(du -sb .devrun | cut -f1)
    echo "to send: $(( (tracked + devrun) / 1048576 )) MiB (tracked files present $(( tracked / 1048576 )), .devrun $(( devrun / 1048576 )))"
    [ $(( tracked + devrun )) -le $send_limit ] || echo "warning: above 60 MiB: the tool may refuse the call (64 MiB by its count)" >&2
    ;;
  restore)
    # the parked files back in the checkout now: the restorer `park` starts calls this, and so can a developer
    # whose call the tool answered without sending the tree (it then never reads .devrun/sent, and the restorer
    # waits PARK_SECONDS); a file that stands in a parked file's place meanwhile is kept, the parked one stays parked
    cd "$root" || exit 1
    put_back() { if [ -e "$2" ]; then echo "kept in $parked: $1 ($2 exists)" >&2; else mv "$1" "$2"; fi; }
    for f in "$parked"/*.safetensors; do
      [ -f "$f" ] && put_back "$f" "$zoo/$(basename "$f" .safetensors)/model.safetensors"
    done
    for f in "$parked"/archives/*/runs-*.tar.xz; do
      [ -f "$f" ] && put_back "$f" "docs/study/$(basename "$(dirname "$f")")/$(basename "$f")"
    done
    echo "in the checkout: $(ls "$zoo"/*/model.safetensors 2>/dev/null | wc -l) zoo weights, $(ls docs/study/*/runs-*.tar.xz 2>/dev/null | wc -l) record archives"
    ;;
  start)
    [ $# -ge 2 ] || usage
    study=$1; shift
    # the first start of a machine copies; a second (another study) joins the same copy and its running queue
    [ -d /root/w ] || cp -r "$root" /root/w || exit 1
    cd /root/w || exit 1
    export TRITON_CACHE_DIR=/root/w/.triton-cache
    carried=$(dirname "$root")/triton-cache.tgz  # .devrun/triton-cache.tgz beside .devrun/w
    if [ -f "$carried" ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
      mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$carried" -C "$TRITON_CACHE_DIR" || echo "triton cache not unpacked"
    fi
    name=$(awk '/^name:/ {print $2; exit}' "$study")
    bash scripts/study/detached.sh start "$study" "runs/study/$name" $# "$@"
    ;;
  collect)
    [ $# -eq 2 ] || usage
    cd /root/w || exit 1
    bash scripts/study/detached.sh watch "$1" "runs/study/$2"
    rm -rf /root/packs
    bash scripts/study/detached.sh pack --no-weights /root/packs "runs/study/$2"
    tar czf "${OUT:?}/$2-runs.tar.gz" -C /root/packs .
    if [ -d /root/w/.triton-cache ]; then
      tar czf /root/triton-cache.tgz -C /root/w/.triton-cache . &&
        if [ "$(stat -c %s /root/triton-cache.tgz)" -lt 15728640 ]; then cp /root/triton-cache.tgz "$OUT/"
        else echo "triton cache over 15 MiB: not returned"; fi
    fi
    ls -la "$OUT"
    ;;
  race-then-seeds)
    [ $# -eq 2 ] || usage
    cd /root/w || exit 1
    export PYTHONPATH=/root/w  # the machine's copy is not installed: the scripts below import linmem from it
    race=runs/study/core-seeds-lr
    bash scripts/study/detached.sh watch "$1" "$race"
    for run in "$race"/runs/*/seed-*; do
      [ -f "$run/items.json" ] || { echo "$run is not evaluated yet: no race decided; watch again" >&2; exit 1; }
    done
    python3 -m linmem.cli study configs/study/core-seeds-lr.yaml --out "$race" --report-only --no-figures \
      > /root/race-report.log 2>&1 || { tail -n 20 /root/race-report.log >&2; exit 1; }
    python3 scripts/study/rate_race.py configs/study/core-seeds-lr.yaml \
      docs/study/core-seeds-lr/results.json "$race/tables/results.json" --decide-seed 100 \
      --core-seeds configs/study/core-seeds.yaml --write \
      | tee "${OUT:?}/race-next.txt" || exit 1
    decided=$(sed -n 's/^written: *//p' "$OUT/race-next.txt")
    [ -n "$decided" ] || { echo "no race newly decided: no core-seeds queue started"; exit 0; }
    queue=$(python3 scripts/study/core_seeds_queue.py configs/study/core-seeds.yaml \
            runs/study/core-seeds --models $decided --size "$2" | sed -n 2p) || {
      echo "core_seeds_queue.py failed: no core-seeds queue started" >&2; exit 1; }
    [ -n "$queue" ] || { echo "no core-seeds run pending for $decided"; exit 0; }
    bash "$self" start configs/study/core-seeds.yaml $queue
    ;;
  *) usage ;;
esac
