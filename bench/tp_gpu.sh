#!/usr/bin/env bash
# The tensor-parallel benchmarks on a 2-GPU host, in one device call (kind
# nvidia-h200-x2, about 5 minutes): TP1 vs TP2 decode steps (batch 1, 32, 128) and 4k
# prefill with the collectives' share (bench/tp_bench.py), then a 2k-token request from a
# TP2 producer (cuda:0+1) to a TP1 consumer (cuda:1) through a live cluster, over the ipc
# and the ucx backend (bench/tp_transfer_bench.py). Each step logs to OUT/NAME.log.
#   bash bench/tp_gpu.sh OUT_DIR
#   STEPS="transfer_ipc" bash bench/tp_gpu.sh OUT_DIR     (only those steps)
#   MODE=cpu bash bench/tp_gpu.sh OUT_DIR                 (toy-size dry run on a CPU host)
set -uo pipefail
out=${1:?OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [ -d .whl ]; then  # what the device lacks (pyzmq, ucxx, grpcio, ...), as in gpu_suite.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export UCX_WARN_UNUSED_ENV_VARS=n
py=${PYTHON:-python3}
mkdir -p "$out"
if [ "${MODE:-gpu}" = cpu ]; then
  tp_args=(--device cpu --preset tiny --batches 1,4 --prefill 256 --context 64 --steps 3
           --kv-cache-mib 64 --collective-iters 5)
  xfer_args=(--preset tiny --devices cpu,cpu --tokens 256 --chunk 64 --kv-cache-mib 64
             --reps 2 --warmup 1)
else
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpus.txt" 2>&1
  tp_args=()
  xfer_args=()
fi
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
step() {  # step NAME SECONDS CMD...: log to OUT/NAME.log, print its tail
  name=$1; secs=$2; shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name: $*"
  start=$(date +%s)
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s"
  tail -"${TAILN:-8}" "$out/$name.log"
}
TAILN=4 step tp_bench 270 "$py" bench/tp_bench.py "${tp_args[@]}" --out "$out/tp_bench.json"
step transfer_ipc 140 "$py" bench/tp_transfer_bench.py "${xfer_args[@]}" --backend ipc \
  --out "$out"
step transfer_ucx 140 "$py" bench/tp_transfer_bench.py "${xfer_args[@]}" --backend ucx \
  --out "$out"
# the headline numbers, one line each
"$py" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
try:
    runs = json.load(open(os.path.join(out, "tp_bench.json")))["runs"]
    for r in runs:
        print(f"tp{r['tp']} graphs={r['cuda_graphs']}", {k: v for k, v in r.items()
              if k.endswith("_ms")}, r.get("goals", ""))
        for name, c in r.get("collectives", {}).items():
            print(f"  {name}: collectives {c['allreduce_ms']} ms = {c['allreduce_share']:.1%}")
except (OSError, ValueError, KeyError) as e:
    print("tp_bench: no result", e)
for b in ("ipc", "ucx"):
    try:
        print(b, json.load(open(os.path.join(out, f"tp_transfer_{b}.json"))).get("summary"))
    except (OSError, ValueError) as e:
        print(b, "no result", e)
EOF
