#!/usr/bin/env bash
# On one H200: the serving path at the seeds' concurrency, P and D sharing the GPU.
# Dummy Llama-3-8B, bf16. One P/D cluster (router + producer + consumer, each its own
# process, as a multi-node recipe starts them; the producer gets a small KV pool, the
# consumer a large one) serves, in turn:
#   prefill1 : 2048 in / 1 out, c=1         one full prefill step (the burst's GPU time unit)
#   hold     : 128 in / 16 out, c=16 (hold256: c=256)  first-token hold (router sent - producer sampled)
#   long     : 128 in / 1024 out, c=256,512 failures, TPOT, ITL, TTFT under long outputs
#   seeds    : 1024 in / 32 out, c=256      the seeds' own load
# then one colocated worker serves `long` at c=256, and bench/decode_bench.py times the
# engine's own decode step at the batches the consumer ran (the TPOT reference).
#   bash bench/serving_path_gpu.sh OUT_DIR [PRESET] [DEVICE] [CONSUMER_KV_MIB]
# CPU dry run at toy size:
#   NUM=8 LONG=32 bash bench/serving_path_gpu.sh /tmp/dry tiny cpu 512
# P_TOKENS / CO_TOKENS: the producer's / colocated worker's --max-num-batched-tokens (2048):
# on a shared GPU a producer's prefill step runs beside the consumer's decode step and
# stretches it, so the prefill chunk bounds the consumer's ITL p99.
# ONLY="pd_prefill1 pd_hold": run only the named points (the P/D cluster alone unless
# co_long is named; then no decode_bench reference either)
# ROUTER_ARGS / DOOR: extra router flags, and the port the clients use (default 50051, the
# grpc.aio door), e.g. ROUTER_ARGS="--grpc-stream-port 50052" DOOR=50052 for the
# hand-framed gRPC door (about half the router's CPU per token), or "--frontends 4"
# BENCH_ARGS: extra flags for every bench point, e.g. "--connections 8" beside
# ROUTER_ARGS="--frontends 4" (one client connection reaches one frontend)
# WORKER_ARGS: extra flags for every worker, e.g. "--simulate-step-ms 10
# --simulate-prefill-us-per-token 20" for simulated engines (the host free while a step
# "runs", as on a GPU: a CPU dry run of what the GPU's step overlap changes)
# SERVE_PY: what runs the router and the workers (default python3), e.g.
# "python3 bench/probes/gc_garbage_probe.py --save-all" for their collections and cyclic garbage
# BENCH_PY: what runs the bench client (default python3), e.g. the same probe as SERVE_PY
# for the client's own collections (they show up in its inter-token gaps as the server's)
# CONSUMER_ARGS: extra consumer flags, e.g. "--no-launch-pacing" (the launch at once, as
# before worker/launch_pacer.py)
# STALLS=1: the router, its frontends and the workers' gRPC processes record their event
# loops' stalls (deploy/loop_stalls.py) under OUT/stalls, and bench/loop_stalls_report.py
# lines them up with the P/D points' slowest holds in OUT/stalls.txt (a diagnosis: the
# recorder's 1 ms ticker costs each loop ~1,000 wake-ups a second)
set -uo pipefail
out=${1:?OUT_DIR}; preset=${2:-llama3-8b}; dev=${3:-cuda:0}; ckv=${4:-76000}
# The default consumer pool is sized for an H200 (141 GB beside two 8B models and the
# producer's pool): on a smaller card the consumer's engine fails at start-up, after the
# model is built, and every point of the run is lost (session 31 burnt 9 device minutes so
# on an H100). Refuse at once instead; a smaller card takes an explicit CONSUMER_KV_MIB.
if [ -z "${4:-}" ] && [ "$dev" != cpu ] && command -v nvidia-smi >/dev/null; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
  if [ "${mib:-0}" -lt 130000 ]; then
    echo "serving_path_gpu.sh: the default consumer KV pool (76000 MiB) needs an H200; this" \
         "GPU has ${mib} MiB: pass CONSUMER_KV_MIB (the 4th argument), e.g. 15000" >&2
    exit 2
  fi
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# SITE_DIR: a directory whose sitecustomize.py every Python process of the run imports first
# (a probe that must reach the router's mirror frontends too, which start without SERVE_PY),
# e.g. bench/probes/spin_site: router loops that never sleep
[ -n "${SITE_DIR:-}" ] && export PYTHONPATH="$(cd "$SITE_DIR" && pwd):$PYTHONPATH"
mkdir -p "$out"
[ "${STALLS:-0}" = 1 ] && export PDSERVE_LOOP_STALLS="$out/stalls"
# pdserve installs uvloop and its processes run on it ("auto"); a Python without it (the GPU
# machine's, unless the run carries the wheel) measures asyncio's loop instead: say so
# the host's CPU and load: the hold and the ITL tails are host time, and two machines with the
# same GPU gave first-token holds 3x apart (bench/RESULTS.md, session 38)
{ nproc; lscpu 2>/dev/null | grep -m1 "Model name"; uptime
  python3 bench/probes/host_speed.py; } > "$out/host.txt" 2>&1
python3 -c "import uvloop" 2>/dev/null || echo "serving_path_gpu.sh: no uvloop here; the" \
  "router and workers run asyncio's loop, which costs more per message (carry its wheel)" >&2
work=$(mktemp -d)
M=$work/model
NUM=${NUM:-0}  # 0: the sizes above; N: every point at most N prompts (dry runs)
LONG=${LONG:-1024}
python3 -m deploy.benchmark.dummy_model "$M" --preset "$preset" || exit 1
common=(--model "$M" --load-format dummy --device "$dev" --max-model-len 4096
        --max-num-batched-tokens 2048 --max-num-seqs 512)
[ "$dev" = cpu ] || common+=(--dtype bfloat16)
# shellcheck disable=SC2206 # WORKER_ARGS: several flags
common+=(${WORKER_ARGS:-})
n() { if [ "$NUM" -gt 0 ] && [ "$NUM" -lt "$1" ]; then echo "$NUM"; else echo "$1"; fi; }

# The processes this run started (router, workers): stop_all ends these and their children
# only. A pattern (pkill -f "deploy.cli router") also ended any other cluster on the host, a
# test suite's among them (session 43).
started=()
start_router() {
  # shellcheck disable=SC2086 # ROUTER_ARGS: several flags
  ${SERVE_PY:-python3} -m deploy.cli router --host 127.0.0.1 --grpc-port 50051 --model "$M" ${ROUTER_ARGS:-} \
    > "$out/router_$1.log" 2>&1 &
  echo $! > "$work/router.pid"
  started+=($!)
}
alive() {  # any of these pids still running (an exited child stays a zombie until waited for)
  local p st
  for p in "$@"; do
    st=$(ps -o stat= -p "$p" 2>/dev/null) || continue
    [ "${st#Z}" = "$st" ] && return 0
  done
  return 1
}
wait_workers() {  # until the router lists $1 workers; at once if the router has exited
  local pid stop=$((SECONDS + 400))
  pid=$(cat "$work/router.pid" 2>/dev/null)
  while [ $SECONDS -lt $stop ]; do
    if [ -n "$pid" ] && ! alive "$pid"; then  # e.g. a flag its Python lacks a module for
      echo "the router exited before the workers registered: see its log" >&2; return 1
    fi
    python3 - "$1" <<'EOF' && return 0
import sys, grpc
from pdserve.v1 import router_pb2, router_pb2_grpc
try:
    with grpc.insecure_channel("127.0.0.1:50051") as ch:
        st = router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(),
                                                        timeout=2)
    sys.exit(0 if len(st.workers) >= int(sys.argv[1]) else 1)
except grpc.RpcError:
    sys.exit(1)
EOF
    sleep 2
  done
  echo "workers did not register" >&2; return 1
}
seed=0
bench() {  # NAME, then pdserve bench flags
  local name=$1; shift
  # each point its own prompts: with one seed, a point's prompts are the earlier points'
  # and the consumer's prefix cache serves them (local prefill, no producer, no hold)
  seed=$((seed + 1))
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  # shellcheck disable=SC2086 # BENCH_ARGS: several flags
  timeout 400 ${BENCH_PY:-python3} -m deploy.cli bench --router "127.0.0.1:${DOOR:-50051}" \
    --status-router 127.0.0.1:50051 --model "$M" --ignore-eos \
    --request-timeout 300 --warmup 2 --seed "$seed" --result-json "$out/$name.json" \
    --markdown "$out/$name.md" ${BENCH_ARGS:-} "$@" > "$out/$name.log" 2>&1
  echo "bench $name exit $?"; tail -4 "$out/$name.md" 2>/dev/null
}
stop_all() {  # SIGTERM (workers drain, the router stops its mirror frontends), then SIGKILL
  [ ${#started[@]} -gt 0 ] || return 0
  kill -TERM "${started[@]}" 2>/dev/null
  for _ in $(seq 20); do
    alive "${started[@]}" || break
    sleep 0.5
  done
  for p in "${started[@]}"; do pkill -KILL -P "$p"; kill -KILL "$p"; done 2>/dev/null
  wait "${started[@]}" 2>/dev/null
  started=()
  sleep 1  # the ports' sockets closed before the next cluster binds them
}

# ---- P/D, sharing the GPU ----
start_router pd
${SERVE_PY:-python3} -m deploy.cli producer --router 127.0.0.1:50051 "${common[@]}" \
  --max-num-batched-tokens "${P_TOKENS:-2048}" --kv-cache-mib 8000 \
  --metrics-port 9101 --worker-id worker-0 > "$out/producer.log" 2>&1 &
started+=($!)
# shellcheck disable=SC2086 # CONSUMER_ARGS: several flags
${SERVE_PY:-python3} -m deploy.cli consumer --router 127.0.0.1:50051 "${common[@]}" --kv-cache-mib "$ckv" \
  --metrics-port 9102 --worker-id worker-1 ${CONSUMER_ARGS:-} > "$out/consumer.log" 2>&1 &
started+=($!)
if wait_workers 2; then
  bench pd_prefill1 --input-len 2048 --output-len 1 --concurrency 1 --num-prompts "$(n 4)"
  bench pd_hold --input-len 128 --output-len 16 --concurrency 16 --num-prompts "$(n 256)"
  bench pd_hold256 --input-len 128 --output-len 16 --concurrency 256 --num-prompts "$(n 256)"
  bench pd_long --input-len 128 --output-len "$LONG" --concurrency 256,512 \
    --num-prompts "$(n 512)"
  bench pd_seeds --input-len 1024 --output-len 32 --concurrency 256 --num-prompts "$(n 256)"
  grep -c "stopped heartbeating\|no heartbeat" "$out/router_pd.log"
fi
stop_all
if [ "${STALLS:-0}" = 1 ]; then
  python3 bench/loop_stalls_report.py "$out/stalls" "$out"/pd_*.json > "$out/stalls.txt" 2>&1
fi

# ---- one colocated worker ----
if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" co_long "* ]]; then rm -rf "$work"; exit 0; fi
start_router co
${SERVE_PY:-python3} -m deploy.cli colocated --router 127.0.0.1:50051 "${common[@]}" \
  --max-num-batched-tokens "${CO_TOKENS:-2048}" \
  --kv-cache-mib "$ckv" --metrics-port 9103 --worker-id worker-0 > "$out/colocated.log" 2>&1 &
started+=($!)
if wait_workers 1; then
  bench co_long --input-len 128 --output-len "$LONG" --concurrency 256 --num-prompts "$(n 256)"
fi
stop_all

# ---- the engine's own decode step (the TPOT reference), same GPU, same run ----
if [ "$dev" != cpu ]; then
  timeout 300 python3 bench/decode_bench.py --batches 16,256,512 --contexts 640 --hf-batches "" \
    --steps 20 --out "$out/decode_ref.json" > "$out/decode_ref.log" 2>&1
  echo "decode_bench exit $?"; tail -8 "$out/decode_ref.log"
fi
