#!/usr/bin/env bash
# Pack the shipped zoo for a remote GPU machine that receives a copy of the working tree with a size limit (64 MiB
# for the device tool this project uses), which the package's models (about 65 MB) alone exceed.
#
#   bash scripts/zoo/device_carry.sh [OUT]      # default OUT: runs/device-carry
#
# OUT then holds each shipped model as NAME.tar.xz (about 6.9 MB each, 46 MB in all), the held-out text (_heldout/)
# and setup.sh. To use it: move linmem/zoo/models out of the working tree for the copy (and back afterwards), send
# OUT, data/zoo-4k and the FLA wheels (.whl/) along, and begin every remote command with
#
#   bash OUT/setup.sh && export PYTHONPATH=$PWD:/tmp/site
#
# setup.sh installs the wheels into /tmp/site and unpacks the models into linmem/zoo/models; run it in every call,
# since each call copies the working tree afresh and the unpacked models do not survive that.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-runs/device-carry}"
zoo=linmem/zoo/models
[ -d "$zoo" ] || { echo "no $zoo here (parked?): nothing to pack" >&2; exit 1; }
mkdir -p "$out"
for model in "$zoo"/*/; do
  name=$(basename "$model")
  case "$name" in _*) continue ;; esac
  XZ_OPT="-T2 -6" tar cJf "$out/$name.tar.xz" -C "$zoo" "$name"
done
rm -rf "$out/_heldout"
cp -r "$zoo/_heldout" "$out/_heldout"
cat > "$out/setup.sh" <<EOF
# made by scripts/zoo/device_carry.sh: run from the repository root on the GPU machine
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p $zoo
for f in $out/*.tar.xz; do tar xf "\$f" -C $zoo; done
rm -rf $zoo/_heldout && cp -r $out/_heldout $zoo/_heldout
ls $zoo
EOF
du -sh "$out"
