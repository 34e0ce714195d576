#!/usr/bin/env bash
# The FP8 KV cache on one H200, in one device call (kind nvidia-h200, about 6 minutes): the
# float8 KV GPU tests (kernels against the references at real sizes, the engine with a
# float8 pool against the reference kernels), then bench/fp8_kv_bench.py (decode attention
# bf16 vs fp8 KV at batch >= 32 and context >= 4k, KV capacity of the same memory).
#   bash bench/fp8_kv_gpu.sh OUT_DIR     -> OUT_DIR/fp8_kv_h200.json, fp8_kv_tests.{log,xml}
set -uo pipefail
out=${1:?OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
if [ -d .whl ]; then  # what the device lacks, as in gpu_suite.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpus.txt" 2>&1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kv_fp8.py \
  --junitxml="$out/fp8_kv_tests.xml" 2>&1 | tee "$out/fp8_kv_tests.log" | tail -5
python3 bench/fp8_kv_bench.py --out "$out/fp8_kv_h200.json" 2>&1 | tee "$out/fp8_kv_bench.log" \
  | tail -12
