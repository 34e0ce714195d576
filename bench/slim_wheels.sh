#!/usr/bin/env bash
# Slims the libucx wheel in .whl (from ../shared/gpu/wheels.sh) so the tree plus the wheels
# fit a GPU run's 64 MiB carry: drops the static libraries, the perftest plugins and the
# demo binaries (nothing pdserve or ucxx loads), and their lines in the wheel's RECORD.
# 42 MB -> about 18 MB. Then the third copy of each shared library: a wheel cannot hold
# symlinks, so libX.so, libX.so.0 and libX.so.0.0.0 are three files. libucx/load.py opens
# libX.so, the libraries and ucxx's need libX.so.0 (their SONAMEs), and UCX loads its
# modules as lib/ucx/*.so (the extension of the libucs it was loaded as); nothing opens
# libX.so.0.0.0 (readelf -d of every library in it; UCX_LOG_LEVEL=debug shows what loads).
# That is ~16 MB unpacked, ~6 MB of the wheel (17.7 -> 11.8 MB), which the tree's growth
# needs (session 43: tree plus wheels were at 62 of the 64 MiB). Also the headers and libtool
# files. Checked on CPU (tests/transfer -k ucx with these cu13 wheels on PYTHONPATH, 53 passed)
# and on an H100, the transfer GPU tests among the GPU suite's (bench/results/gpu_suite.txt,
# session 44).
# Run from the project root, after wheels.sh:
#   bash bench/slim_wheels.sh
set -euo pipefail
for whl in .whl/libucx_*.whl; do
  [ -e "$whl" ] || { echo "no libucx wheel in .whl" >&2; exit 1; }
  tmp=$(mktemp -d)
  unzip -q "$whl" -d "$tmp"
  (cd "$tmp" && find libucx -type f \( -name '*.a' -o -name '*perftest*' -o -path 'libucx/bin/*' \
     -o -name '*.so.0.0.0' -o -name '*.la' -o -path 'libucx/include/*' \) \
     -print -delete > removed.txt)
  rec=$(ls "$tmp"/*.dist-info/RECORD)
  grep -v -F -f "$tmp/removed.txt" "$rec" > "$rec.new" && mv "$rec.new" "$rec"
  rm "$tmp/removed.txt"
  before=$(stat -c %s "$whl")
  rm "$whl"
  (cd "$tmp" && zip -q -r -X "$OLDPWD/$whl" .)
  echo "$whl: $before -> $(stat -c %s "$whl") bytes"
  rm -rf "$tmp"
done
