#!/usr/bin/env bash
# The first-token hold and the seeds' load, this tree against another one, alternated in one
# device call (one H200, P and D sharing it; bench/serving_path_gpu.sh's pd_hold, pd_hold256
# and pd_seeds points, a fresh cluster each run). The other tree is a plain copy of an
# earlier commit's source made here before the call, which travels with the working tree:
#   mkdir ab_old && git archive OLD -- router worker producer consumer engine kernels \
#       transfer deploy proto bench/serving_path_gpu.sh | tar x -C ab_old
#   bash bench/serving_path_ab_gpu.sh OUT ab_old [ROUNDS]
# Each run starts in its tree's root: `python -m` puts the working directory first on
# sys.path, so a run started elsewhere would import that directory's code. Rounds
# alternate the order (old new, new old, ...). Prints bench/hold_summary.py's table.
# AB_ONLY: the points (default "pd_hold pd_hold256 pd_seeds"); AB_TIMEOUT: seconds a run.
# AB_PRESET / AB_DEVICE: the model preset and device (default llama3-8b on cuda:0); on this
# CPU with simulated engines, e.g. AB_PRESET=tiny AB_DEVICE=cpu CONSUMER_KV_MIB=512
# WORKER_ARGS="--simulate-step-ms 10 --simulate-prefill-us-per-token 20".
set -uo pipefail
out=${1:?OUT_DIR}; old=$(cd "${2:?OLD_TREE}" && pwd); rounds=${3:-3}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 0 ]; then order="new old"; else order="old new"; fi
  for t in $order; do
    if [ "$t" = old ]; then root=$old; else root=$repo; fi
    echo "$(date -u +%T) round $r $t"
    (cd "$root" && ONLY="${AB_ONLY:-pd_hold pd_hold256 pd_seeds}" timeout "${AB_TIMEOUT:-160}" \
      bash bench/serving_path_gpu.sh "$out/$t$r" "${AB_PRESET:-llama3-8b}" "${AB_DEVICE:-cuda:0}" \
        "${CONSUMER_KV_MIB:-}" > "$out/$t$r.log" 2>&1)
  done
done
python3 "$repo/bench/hold_summary.py" "$out"
