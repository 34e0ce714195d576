#!/usr/bin/env bash
# `pdserve bench --compare` on a 2-GPU host: 1P1D (producer cuda:0, consumer cuda:1) against
# 2 colocated workers (cuda:0, cuda:1), dummy-weight Llama-3-8B shape, bf16, 4k in / 256 out.
#   bash bench/serving_gpu.sh OUT_DIR [PRESET] [DEVICES] [KV_MIB] [extra pdserve bench flags]
# CPU dry run of the same command at toy size:
#   bash bench/serving_gpu.sh /tmp/dry tiny cpu,cpu 512 --worker-arg=--threads=1
set -uo pipefail
out=${1:?OUT_DIR}; preset=${2:-llama3-8b}; devices=${3:-cuda:0,cuda:1}; kv=${4:-16384}
shift $(( $# < 4 ? $# : 4 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
work=$(mktemp -d)
python3 -m deploy.benchmark.dummy_model "$work/model" --preset "$preset" || exit 1
timeout ${SERVING_TIMEOUT:-480} python3 -m deploy.cli bench --compare --model "$work/model" --devices "$devices" \
  --worker-arg=--load-format=dummy --worker-arg=--dtype=bfloat16 \
  --worker-arg=--kv-cache-mib="$kv" --worker-arg=--max-num-batched-tokens=2048 \
  --worker-arg=--max-model-len=8192 \
  --input-len 4096 --output-len 256 --ignore-eos --num-prompts ${NUM_PROMPTS:-32} --warmup 2 \
  --concurrency 1,4 --request-timeout 120 --goodput ttft:1000 tpot:25 \
  --result-json "$out/serving.json" --markdown "$out/serving.md" --log-dir "$work/logs" "$@"
rc=$?
tar -czf "$out/logs.tgz" -C "$work" logs 2>/dev/null
echo "pdserve bench exit code: $rc"
exit $rc
