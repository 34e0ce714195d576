#!/usr/bin/env bash
# The serving plane at GPU token rates without GPUs (simulated engines): 1,000
# concurrent streaming clients against simulated workers, one router frontend, then N.
# Meant for a 16-core host (the GPU machine, GPUs unused); each run prints one summary line
# and writes its JSON.
#   bash bench/serving_plane_sim.sh OUT_DIR [FRONTENDS_LIST] [extra serving_cpu_bench flags]
#   e.g. bash bench/serving_plane_sim.sh /tmp/sim "1 4"
# FRONTENDS_LIST "1" runs the router as it is; N > 1 passes --frontends=N to the router
# (the scaled-out front door's flag; older routers refuse it).
# Offered load: 4 consumers x 250 streams, 10 ms steps -> up to 100k tokens/s; the
# acceptance is >= 50k tokens/s through one frontend, and 4 frontends >= 3.5x one.
set -uo pipefail
out=${1:?OUT_DIR}; frontends=${2:-"1 4"}
shift $(( $# < 2 ? $# : 2 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
rc=0
for n in $frontends; do
  extra=()
  [ "$n" -gt 1 ] && extra+=("--router-arg=--frontends=$n")
  timeout ${SIM_TIMEOUT:-580} python3 "$repo/bench/serving_cpu_bench.py" \
    --simulate-step-ms ${STEP_MS:-10} --producers 1 --consumers ${CONSUMERS:-4} \
    --concurrency ${CONCURRENCY:-1000} --num-prompts ${NUM_PROMPTS:-2000} \
    --input-len 64 --output-len ${OUTPUT_LEN:-256} --client-procs ${CLIENT_PROCS:-4} \
    --out "$out/sim_frontends$n.json" --log-dir "$out/logs_frontends$n" "${extra[@]}" "$@" \
    || rc=$?
done
echo "serving_plane_sim exit code: $rc"
exit $rc
