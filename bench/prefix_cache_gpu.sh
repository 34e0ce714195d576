#!/usr/bin/env bash
# Prefix caching on one H200 (P and D share the GPU): 1P1D with --policy cache_aware, the
# workload SGLang's generated-shared-prefix at 2k-token system prompts (8 groups x 16
# prompts, 128-token questions, 128 output tokens), with the prefix cache on and off in
# one run (--compare-prefix-caching). Dummy-weight Llama-3-8B shape, bf16.
# Acceptance: TTFT p50 with caching >= 4x lower than without; TPOT p50 within 5%.
#   bash bench/prefix_cache_gpu.sh OUT_DIR [PRESET] [DEVICES] [KV_MIB] [extra bench flags]
# CPU dry run at toy size:
#   bash bench/prefix_cache_gpu.sh /tmp/dry tiny cpu,cpu 256 --sp-system-len 256 \
#     --sp-question-len 16 --output-len 8 --worker-arg=--threads=1
set -uo pipefail
out=${1:?OUT_DIR}; preset=${2:-llama3-8b}; devices=${3:-cuda:0,cuda:0}; kv=${4:-24576}
shift $(( $# < 4 ? $# : 4 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
work=$(mktemp -d)
python3 -m deploy.benchmark.dummy_model "$work/model" --preset "$preset" || exit 1
# (later flags win: extra flags may override the workload's sizes)
timeout ${PREFIX_TIMEOUT:-480} python3 -m deploy.cli bench --launch pd --producers 1 --consumers 1 \
  --model "$work/model" --devices "$devices" --policy cache_aware --compare-prefix-caching \
  --worker-arg=--load-format=dummy --worker-arg=--dtype=bfloat16 \
  --worker-arg=--kv-cache-mib="$kv" --worker-arg=--max-num-batched-tokens=2048 \
  --worker-arg=--max-model-len=4096 \
  --dataset shared-prefix --sp-groups 8 --sp-prompts-per-group 16 --sp-system-len 2048 \
  --sp-question-len 128 --output-len 128 --ignore-eos --warmup 2 --num-prompts 128 \
  --concurrency 1,8 --request-timeout 120 \
  --result-json "$out/prefix_cache.json" --markdown "$out/prefix_cache.md" \
  --log-dir "$work/logs" "$@"
rc=$?
tar -czf "$out/logs.tgz" -C "$work" logs 2>/dev/null
echo "pdserve bench exit code: $rc"
exit $rc
