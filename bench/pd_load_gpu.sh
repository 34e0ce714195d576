#!/usr/bin/env bash
# The seeds' own load on a 2-GPU host: 1P1D (producer cuda:0, consumer cuda:1),
# dummy Llama-3-8B, bf16, 256 requests at concurrency 256, 1024 in / 32 out; then, on cuda:0
# in the same call, the engine's own decode step at the batch sizes the consumer ran
# (bench/decode_bench.py at context 1040), the reference its TPOT is compared against.
#   bash bench/pd_load_gpu.sh OUT_DIR [PRESET] [DEVICES] [KV_MIB] [extra pdserve bench flags]
# CPU dry run at toy size:
#   REF_BATCHES= bash bench/pd_load_gpu.sh /tmp/dry tiny cpu,cpu 512 --num-prompts 8 --concurrency 8
set -uo pipefail
out=${1:?OUT_DIR}; preset=${2:-llama3-8b}; devices=${3:-cuda:0,cuda:1}; kv=${4:-49152}
shift $(( $# < 4 ? $# : 4 ))
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
work=$(mktemp -d)
python3 -m deploy.benchmark.dummy_model "$work/model" --preset "$preset" || exit 1
timeout ${LOAD_TIMEOUT:-300} python3 -m deploy.cli bench --launch pd --model "$work/model" \
  --devices "$devices" \
  --worker-arg=--load-format=dummy --worker-arg=--dtype=bfloat16 \
  --worker-arg=--kv-cache-mib="$kv" --worker-arg=--max-num-batched-tokens=2048 \
  --worker-arg=--max-model-len=2048 --worker-arg=--max-num-seqs=256 \
  --input-len 1024 --output-len 32 --ignore-eos --num-prompts 256 --warmup 2 \
  --concurrency 256 --request-timeout 240 \
  --result-json "$out/pd_load.json" --markdown "$out/pd_load.md" --log-dir "$work/logs" "$@"
rc=$?
tar -czf "$out/pd_load_logs.tgz" -C "$work" logs 2>/dev/null
echo "pdserve bench exit code: $rc"
if [ -n "${REF_BATCHES-8,16,32,64,128,256}" ]; then
  python3 bench/decode_bench.py --batches "${REF_BATCHES-8,16,32,64,128,256}" --contexts 1040 \
    --hf-batches "" --steps 20 --out "$out/decode_ref.json" > "$out/decode_ref.log" 2>&1
  echo "decode_bench exit code: $?"; tail -12 "$out/decode_ref.log"
fi
exit $rc
