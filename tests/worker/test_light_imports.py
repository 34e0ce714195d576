"""A worker's gRPC process and the router never load torch, triton or transformers.

Only a worker's engine process runs the model. Importing torch costs 2-6 s on a small
machine, and every worker start and respawn paid it twice (gRPC process and engine
process); the router must start in well under a second on a host with no GPU. The first
tests import what each process imports and builds what it builds, in a fresh interpreter;
the last one reads the mapped libraries of a live cluster's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from live_cluster import dump_logs

from deploy.cluster import LocalCluster

HEAVY = ("torch", "triton", "transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter: imports the modules in argv[1], runs the code in argv[2],
# then prints, for each package of argv[3] loaded, the frames under the repository root
# (argv[4]) that first imported it.
PROBE = """
import importlib, json, sys, traceback
HEAVY, ROOT = sys.argv[3].split(","), sys.argv[4]
first = {}

class Spy:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in first:
            first[top] = [f"{f.filename}:{f.lineno} {f.line}" for f in traceback.extract_stack()
                          if f.filename.startswith(ROOT) and "/.venv/" not in f.filename]
        return None

sys.meta_path.insert(0, Spy())
for m in sys.argv[1].split(","):
    importlib.import_module(m)
exec(sys.argv[2])
print(json.dumps({k: first.get(k, ["(loaded)"]) for k in HEAVY if k in sys.modules}))
"""

WORKER_MODULES = ("deploy.cli", "deploy.worker_cmd", "worker.runner", "worker.server",
                  "worker.servicer", "worker.engine_loop", "worker.role", "producer.role",
                  "producer.servicer", "consumer.role", "consumer.servicer",
                  # what the gRPC process and the engine exchange, and what it converts
                  "worker.messages", "worker.convert", "engine.sampling_params",
                  "engine.outputs", "engine.config")
# what `pdserve producer|consumer|colocated` builds before it starts the engine process,
# with --device auto (the default), for every role (a role change rebuilds another)
WORKER_BUILD = """
from deploy.cli import build_parser
from deploy.worker_cmd import ROLE_PARTS, spec_from_args
from worker.server import WorkerConfig
for role in ROLE_PARTS:
    args = build_parser().parse_args([role, "--router", "127.0.0.1:1"])
    spec = spec_from_args(args, role)
    WorkerConfig(spec=spec, servicer=ROLE_PARTS[role][1], router=args.router)
"""
ROUTER_MODULES = ("deploy.cli", "deploy.router_cmd", "router.server")
ROUTER_BUILD = """
from deploy.cli import build_parser
from deploy.router_cmd import router_config
from router.server import RouterServer
RouterServer(router_config(build_parser().parse_args(["router"])))
"""
# `pdserve launch` checks its flags and model, then starts every service as a process
LAUNCH_BUILD = """
from deploy.cli import build_parser
from deploy.launch_checks import check_devices, check_model
args = build_parser().parse_args(["launch"])
check_devices(("auto",))
check_model(args.model)
"""


def _heavy_loaded(modules: tuple[str, ...], code: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(modules), code, ",".join(HEAVY),
                          ROOT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded: dict[str, list[str]] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize(("modules", "code"), [
    (WORKER_MODULES, WORKER_BUILD), (ROUTER_MODULES, ROUTER_BUILD),
    (("deploy.cli",), LAUNCH_BUILD),
], ids=["worker-grpc-process", "router", "launch"])
def test_process_loads_no_torch_triton_or_transformers(modules: tuple[str, ...],
                                                       code: str) -> None:
    loaded = _heavy_loaded(modules, code)
    assert loaded == {}, "\n".join(f"{k} imported via:\n  " + "\n  ".join(v)
                                   for k, v in loaded.items())


def test_the_probe_sees_a_heavy_import() -> None:
    """The check above can fail: the engine's own module does load torch."""
    loaded = _heavy_loaded(("engine.llm_engine",), "")
    assert "torch" in loaded
    assert any("engine/llm_engine.py" in frame for frame in loaded["torch"])


def test_cuda_probe_agrees_with_torch_without_importing_it() -> None:
    code = ("import sys, json\nfrom engine.cuda_probe import has_cuda\nans = has_cuda()\n"
            "light = 'torch' not in sys.modules\nimport torch\n"
            "print(json.dumps([ans, torch.cuda.is_available(), light]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    probe, torch_says, light = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe == torch_says
    assert light, "has_cuda() imported torch"


# ---- a live cluster: the libraries each process has mapped ------------------------------

def _mapped_heavy(pid: int) -> set[str]:
    """The torch/triton shared libraries mapped into a process (transformers has none: the
    import tests above cover it)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return {p for p in paths if "/site-packages/torch/" in p or "/site-packages/triton/" in p}


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.fixture(scope="module")
def cluster(worker_1p1d: LocalCluster) -> LocalCluster:
    return worker_1p1d  # tests/worker/conftest.py: shared, nothing here changes it


@pytest.mark.slow
def test_live_grpc_processes_map_no_torch(cluster: LocalCluster) -> None:
    import grpc
    from cluster_client import generate
    from pdserve.v1 import router_pb2_grpc

    # serve a request first: the serving path must stay light too
    with grpc.insecure_channel(cluster.router_address) as ch:
        res = generate(router_pb2_grpc.RouterStub(ch),
                       {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                       prompt="The capital of France is")
    assert res.code is None and len(res.token_ids) == 4, (res, dump_logs(cluster))
    for name in ("router", "worker-0", "worker-1"):
        assert _mapped_heavy(cluster.procs[name].pid) == set(), name
    for name in ("worker-0", "worker-1"):
        # the same check finds torch in the worker's engine process, the one that runs it
        engines = [c for c in _children(cluster.procs[name].pid) if _mapped_heavy(c)]
        assert len(engines) == 1, (name, _children(cluster.procs[name].pid))
        assert any("libtorch" in p for p in _mapped_heavy(engines[0]))
