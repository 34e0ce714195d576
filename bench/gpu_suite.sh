#!/usr/bin/env bash
# The whole `-m gpu` suite in one device call (kind nvidia-h200-x2: the transfer tests need
# two GPUs), with the wheels the device lacks carried in .whl (pyzmq, ucxx for CUDA 13, grpcio 1.84.2 with health and reflection,
# gguf). Only the folders that hold gpu tests are collected (the device lacks some of the
# other suites' client packages, e.g. openai). Logs go to OUT; the summary lines are what bench/results/gpu_suite.txt records.
# The tree plus the default wheels is over a run's 64 MiB carry: run bench/slim_wheels.sh
# after wheels.sh (libucx 42 -> 12 MB), which also leaves room for gguf, llguidance and
# jsonschema, whose tests otherwise skip on the device (llguidance 1.9.1 is tagged
# manylinux_2_31 and jsonschema needs attrs, jsonschema-specifications, referencing and
# rpds-py, so fetch those with pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 -d .whl ...). Fetch
# uvloop==0.23.0 the same way: the device's Python has none, and without it every serving
# process there runs asyncio's loop, which a pip-installed pdserve would not. And h2==4.4.1,
# hpack and hyperframe (pure Python): the router's hand-framed door (--grpc-stream-port)
# imports h2, and without it a router given that flag exits at start (session 43).
#   bash bench/gpu_suite.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpus.txt" 2>&1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
# the graph tests alone: their --gpu-memory-utilization test sizes from memory in use,
# which parallel workers on the same GPU would change
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_decode_graphs.py \
  2>&1 | tee "$out/graphs.log" | tail -3
python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/kernels tests/engine tests/transfer tests/gpu_cluster \
  --deselect tests/engine/test_decode_graphs.py 2>&1 | tee "$out/rest.log" | tail -25
