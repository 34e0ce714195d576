#!/usr/bin/env bash
# `pdserve bench --compare` (1P1D against 2 colocated) at the README's small CPU setting, on
# one commit and on this tree, in one run: BEFORE's cluster and client from a temporary
# worktree, then this tree's, then both again (A B A B), so the spread between the two
# runs of one commit is the noise the difference is read against. ROUNDS (default 2) sets
# how many times each commit runs; bench/compare_noise.py then gives the verdict per point
# (Welch's t over the runs, Holm-corrected over all points) into OUT_DIR/noise.json.
#   [ROUNDS=4] bash bench/protocol_compare.sh OUT_DIR [BEFORE_COMMIT] [extra pdserve bench flags]
# This tree's router runs with --local-prefill-max-tokens -1 (BEFORE has no conditional
# local prefill: a consumer never prefilled); everything else is both commits' defaults.
set -uo pipefail
out=${1:?OUT_DIR}; before=${2:-6317fd3}
shift $(( $# < 2 ? $# : 2 ))
source "$(dirname "$0")/before_tree.sh"
flags=(bench --compare --num-prompts 12 --warmup 2 --input-len 64:256 --output-len 32
       --ignore-eos --rate 0.5,1,inf --goodput ttft:3000 tpot:300
       --worker-arg=--kv-cache-mib=512 "$@")
rc=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "== round $round: $before"
  PYTHONPATH="$wt:$wt/proto" "$py" -m deploy.cli "${flags[@]}" \
    --result-json "$out/before_$round.json" --markdown "$out/before_$round.md" || rc=$?
  echo "== round $round: this tree"
  PYTHONPATH="$repo:$repo/proto" "$py" -m deploy.cli "${flags[@]}" \
    --router-arg=--local-prefill-max-tokens=-1 \
    --result-json "$out/after_$round.json" --markdown "$out/after_$round.md" || rc=$?
done
PYTHONPATH="$repo" "$py" "$repo/bench/compare_noise.py" "$out" || rc=$?
exit $rc
