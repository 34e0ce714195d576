#!/usr/bin/env bash
# Mooncake's conversation trace at full size on one H200: 2P2D (four workers sharing the
# GPU), --policy cache_aware against round_robin in one run. Dummy-weight Llama-3-8B
# shape, bf16, the first 300 requests at 0.2x the trace's times (their own arrivals,
# uncapped), outputs capped at 64 tokens. Acceptance: cache_aware's TTFT p50 >= 2x lower than
# round_robin's, its hit rate >= 80% of the ideal ("of ideal" in the markdown).
#   bash bench/prefix_mooncake_gpu.sh OUT_DIR TRACE_JSONL [PRESET] [DEVICES] [KV_MIB] [flags]
# TRACE_JSONL: mooncake_conversation_trace.jsonl (kvcache-ai/Mooncake, Apache-2.0).
set -uo pipefail
out=${1:?OUT_DIR}; trace=${2:?TRACE_JSONL}; preset=${3:-llama3-8b}
devices=${4:-cuda:0,cuda:0,cuda:0,cuda:0}; kv=${5:-12288}
shift $(( $# < 5 ? $# : 5 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
work=$(mktemp -d)
python3 -m deploy.benchmark.dummy_model "$work/model" --preset "$preset" || exit 1
timeout ${PREFIX_TIMEOUT:-470} python3 -m deploy.cli bench --launch pd --producers 2 --consumers 2 \
  --model "$work/model" --devices "$devices" --policy cache_aware,round_robin \
  --worker-arg=--load-format=dummy --worker-arg=--dtype=bfloat16 \
  --worker-arg=--kv-cache-mib="$kv" --worker-arg=--max-num-batched-tokens=8192 \
  --worker-arg=--max-model-len=32768 \
  --dataset "mooncake:$trace" --max-requests ${MAX_REQUESTS:-300} --trace-block-tokens 512 \
  --trace-time-scale ${TIME_SCALE:-0.2} --output-len 64 --ignore-eos --warmup 2 \
  --request-timeout 300 \
  --result-json "$out/prefix_mooncake.json" --markdown "$out/prefix_mooncake.md" \
  --log-dir "$work/logs" "$@"
rc=$?
tar -czf "$out/logs.tgz" -C "$work" logs 2>/dev/null
echo "pdserve bench exit code: $rc"
exit $rc
