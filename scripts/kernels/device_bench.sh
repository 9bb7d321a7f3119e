#!/usr/bin/env bash
# A benchmark command on the lent GPU, whose machine starts bare every time: FLA's pure-Python wheels carried in
# .whl are installed into /tmp/site, and Triton's compiled kernels and autotuning choices travel between machines, so
# that FLA's first call and linmem's first launches compile and autotune once, not in every session (the first FLA
# cell of a versus_fla command at GDN-1.3B, B = 8 took 314 of its 540 s, of which its 11 steps took about 5).
#
#   device: bash scripts/kernels/device_bench.sh python -m linmem.bench.versus_fla ... --out "$OUT"
#
# with `carry: [".whl", ".devrun/bench-cache"]` (either may be absent). It unpacks the carried cache into
# TRITON_CACHE_DIR, turns Triton's autotuning cache on (TRITON_CACHE_AUTOTUNING: a kernel autotuned on the same
# GPU kind, Triton and arguments keeps its choice), runs the command, and returns the cache packed as
# $OUT/bench-cache/part-0, part-1, ... (15 MiB each, the device tool returns files of at most 16 MiB) when it packs
# into at most CACHE_PARTS (2) of them; here, `rm -rf .devrun/bench-cache && cp -r FILES_AT/bench-cache .devrun/`.
# The parts count towards the 64 MiB a call sends (`core_seeds_device.sh park` prints the total). The command's exit
# status is the script's. Timings are unchanged by the cache: it removes compilation and autotuning, which the
# benchmarks' warm-up steps leave out of their clocks anyway.
set -uo pipefail
[ $# -ge 1 ] || { sed -n 2,16p "$0" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl ||
    echo "the carried wheels did not install" >&2
fi
export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/bench-triton-cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
carried=.devrun/bench-cache
part_bytes=$((15 * 1024 * 1024))
CACHE_PARTS=${CACHE_PARTS:-2}
if compgen -G "$carried/part-*" > /dev/null; then
  cat "$carried"/part-* | tar xzf - -C "$TRITON_CACHE_DIR" &&  # part-0 to part-9 (one digit): the glob's order
    echo "triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files carried"
fi
"$@"
status=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf /tmp/bench-cache.tgz -C "$TRITON_CACHE_DIR" . || exit $status
  size=$(stat -c %s /tmp/bench-cache.tgz)
  if [ "$size" -le $((CACHE_PARTS * part_bytes)) ]; then
    mkdir -p "$OUT/bench-cache" && split -b "$part_bytes" -d -a 1 /tmp/bench-cache.tgz "$OUT/bench-cache/part-"
  else
    echo "triton cache of $((size / 1024 / 1024)) MiB over $CACHE_PARTS parts of 15 MiB: not returned" >&2
  fi
fi
exit $status
