#!/usr/bin/env bash
# CPU per streamed token and failures of the serving path, one commit against another, in
# one run with the same clients and meter (bench/serving_cpu_bench.py --code-tree): the
# cluster of BEFORE runs from a temporary worktree, then this tree's.
#   bash bench/serving_cpu_compare.sh OUT_DIR [BEFORE_COMMIT] [serving_cpu_bench flags]
# Default load: tiny dummy model, 1P1D, c=256, 64 in / 256 out, 256 requests.
set -uo pipefail
out=${1:?OUT_DIR}; before=${2:-3a4cee6}
shift $(( $# < 2 ? $# : 2 ))
source "$(dirname "$0")/before_tree.sh"
flags=(--model tiny-dummy --concurrency 256 --num-prompts 256 --input-len 64 --output-len 256
       "$@")
rc=0
"$py" "$repo/bench/serving_cpu_bench.py" "${flags[@]}" --code-tree "$wt" \
  --out "$out/before.json" || rc=$?
"$py" "$repo/bench/serving_cpu_bench.py" "${flags[@]}" --out "$out/after.json" || rc=$?
exit $rc
