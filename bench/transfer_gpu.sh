#!/usr/bin/env bash
# KV transfer on 2 GPUs of one host, in one device call: the GPU transfer tests, the
# bandwidth sweep for the ipc and ucx backends, and the prefill/transfer overlap of a
# 2k-token Llama-3-8B prompt (dummy weights) for both backends.
#   bash bench/transfer_gpu.sh OUT_DIR        (device kind nvidia-h200-x2)
#   STEPS="sweep_ipc sweep_ucx" bash bench/transfer_gpu.sh OUT_DIR    (only those steps)
set -uo pipefail
out=${1:?OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export UCX_WARN_UNUSED_ENV_VARS=n
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpus.txt" 2>&1
step() {  # step NAME SECONDS CMD...: log to OUT/NAME.log, print its tail
  name=$1; secs=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name: $*"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "exit $?"
  tail -${TAILN:-6} "$out/$name.log"
}
cd "$repo"
step pytest_gpu 240 python3 -m pytest -q -m gpu tests/transfer \
  tests/kernels/test_kv_movement.py -p no:cacheprovider
TAILN=16 step sweep_ipc 150 python3 bench/transfer_bench.py --device cuda --backend ipc \
  --reps 3 --out "$out/sweep_ipc.json"
TAILN=12 step overlap_ipc 150 python3 bench/transfer_overlap_bench.py --device cuda \
  --backend ipc --out "$out/overlap_ipc.json"
TAILN=12 step overlap_ucx 150 python3 bench/transfer_overlap_bench.py --device cuda \
  --backend ucx --out "$out/overlap_ucx.json"
TAILN=16 step sweep_ucx 150 python3 bench/transfer_bench.py --device cuda --backend ucx \
  --reps 3 --out "$out/sweep_ucx.json"
TAILN=16 step sweep_ucx_polling 150 python3 bench/transfer_bench.py --device cuda --backend ucx \
  --progress thread-polling --reps 3 --out "$out/sweep_ucx_polling.json"
