# Sourced by the device scripts (gpu_suite.sh, h200_open_points.sh): sets `repo` and moves
# there; installs the wheels carried in .whl (the device's Python lacks them: pyzmq, ucxx,
# grpcio with health and reflection, uvloop, ...; bench/gpu_suite.sh says which) into
# /tmp/site, and puts that, the tree and its generated protos on PYTHONPATH.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$repo:$repo/proto${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export UCX_WARN_UNUSED_ENV_VARS=n
