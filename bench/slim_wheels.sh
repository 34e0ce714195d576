#!/usr/bin/env bash
# Slims the libucx wheel in .whl (from ../shared/gpu/wheels.sh) so the tree plus the wheels
# fit a GPU run's 64 MiB carry: drops the static libraries, the perftest plugins and the
# demo binaries (nothing pdserve or ucxx loads), and their lines in the wheel's RECORD.
# 42 MB -> about 14 MB. Run from the project root, after wheels.sh:
#   bash bench/slim_wheels.sh
set -euo pipefail
for whl in .whl/libucx_*.whl; do
  [ -e "$whl" ] || { echo "no libucx wheel in .whl" >&2; exit 1; }
  tmp=$(mktemp -d)
  unzip -q "$whl" -d "$tmp"
  (cd "$tmp" && find libucx -type f \( -name '*.a' -o -name '*perftest*' -o -path 'libucx/bin/*' \) \
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
