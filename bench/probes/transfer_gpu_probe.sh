#!/usr/bin/env bash
# Which UCX transport moves GPU0 -> GPU1 KV, and how fast, under a few UCX settings.
#   bash bench/probes/transfer_gpu_probe.sh OUT_DIR
# Each variant runs bench/transfer_bench.py --device cuda once with UCX_PROTO_INFO=y, so the
# log names the protocol and transports UCX picked for each message size.
set -uo pipefail
out=${1:?OUT_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
run() {
  name=$1; shift
  echo "=== $name: $*"
  env UCX_PROTO_INFO=y "$@" timeout 150 python3 "$repo/bench/transfer_bench.py" --device cuda \
    --reps 1 --out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "exit $?"
  grep -iE "cuda_ipc|cuda_copy|rndv|tag_send|GB/s|llama" "$out/$name.log" | sort | uniq -c \
    | sort -rn | head -12
  tail -4 "$out/$name.log"
}
run default
run tls_ipc UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp
run tls_ipc_rndv_put UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp UCX_RNDV_SCHEME=put_zcopy
