#!/usr/bin/env bash
# Packs binaries built here for a device call: twell, twell_tests and every kernel lab of a build,
# stripped into one .carry/NAME/bins.tar.xz (the carry holds 64 MiB; the GPU machine builds nothing).
# The device scripts unpack it (scripts/device/common.sh). OpenBLAS is linked statically, so the
# binaries need no Debian libraries there.
#   scripts/pack_device.sh NAME [BUILD_DIR]   then run with carry [".carry/NAME"]
set -euo pipefail
name=${1:?usage: scripts/pack_device.sh NAME [BUILD_DIR]}
build=${2:-build}
dest=.carry/$name
rm -rf "$dest"
mkdir -p "$dest/staging"
cp "$build/tools/twell" "$build/tests/twell_tests" "$dest/staging/"
for lab in "$build"/lab/cuda/lab_*; do
  [[ -x $lab && -f $lab ]] && cp "$lab" "$dest/staging/"
done
strip "$dest"/staging/*
tar -C "$dest/staging" -cJf "$dest/bins.tar.xz" .
rm -rf "$dest/staging"
size=$(stat -c %s "$dest/bins.tar.xz")
echo "$dest/bins.tar.xz: $((size / 1048576)) MiB"
(( size < 60 * 1048576 )) || { echo "over the carry limit: pack fewer binaries" >&2; exit 1; }
