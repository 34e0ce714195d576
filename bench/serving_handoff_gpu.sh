#!/usr/bin/env bash
# Issue 22's open H200 points in one device call (about 6 minutes; the device returns 8
# files, so pack OUT afterwards: `cd $OUT && tar czf h.tgz h && rm -rf h`):
#  1. the P/D handoff: the hold and seeds' points of bench/serving_path_gpu.sh, then
#     bench/itl_split.py, which splits each point's first inter-token gap into the KV
#     transfer and admission, the wait for the consumer's step, and the rest, and the
#     first-token hold at the producer's send; the hold points again through the router's
#     hand-framed door (half the router's CPU per token: its loop less busy when token 0
#     comes);
#  2. the front door's scale-out: simulated engines (no GPU), 2P8D at 5 ms steps, 2,000
#     streams, one router frontend and four, the clients on the hand-framed HTTP/2 client
#     (--client h2: a fraction of grpcio's CPU per token, leaving the cores to the routers)
#     with 8 connections each (SO_REUSEPORT balances connections, not streams).
#   bash bench/serving_handoff_gpu.sh OUT_DIR [PRESET] [DEVICE] [CONSUMER_KV_MIB]
# SKIP_SIM=1 stops after part 1.
# CPU dry run: NUM=16 SIM_CONSUMERS=2 SIM_CONCURRENCY=64 SIM_PROMPTS=128 SIM_CLIENT_PROCS=1 \
#   bash bench/serving_handoff_gpu.sh /tmp/dry tiny cpu 256
set -uo pipefail
out=${1:?OUT_DIR}; preset=${2:-llama3-8b}; dev=${3:-cuda:0}; ckv=${4:-76000}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
ONLY="pd_hold pd_hold256 pd_seeds" NUM=${NUM:-0} \
  bash "$repo/bench/serving_path_gpu.sh" "$out/handoff" "$preset" "$dev" "$ckv"
ROUTER_ARGS="--grpc-stream-port 50052" DOOR=50052 ONLY="pd_hold pd_hold256" NUM=${NUM:-0} \
  bash "$repo/bench/serving_path_gpu.sh" "$out/handoff_door" "$preset" "$dev" "$ckv"
python3 "$repo/bench/itl_split.py" "$out"/handoff/pd_*.json "$out"/handoff_door/pd_*.json \
  | tee "$out/itl_split.txt"
[ -n "${SKIP_SIM:-}" ] && exit 0  # the hold and handoff points alone
STEP_MS=5 CONSUMERS=${SIM_CONSUMERS:-8} CONCURRENCY=${SIM_CONCURRENCY:-2000} \
  NUM_PROMPTS=${SIM_PROMPTS:-6000} CLIENT_PROCS=${SIM_CLIENT_PROCS:-8} \
  SIM_TIMEOUT=${SIM_TIMEOUT:-200} bash "$repo/bench/serving_plane_sim.sh" "$out/sim" "1 4" \
  --backend grpc-stream --producers 2 --client h2 --connections-per-client 8
