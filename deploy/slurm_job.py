"""The driver of deploy/slurm/pdserve.sbatch, run on the job's first node: places the router
and the workers on the job's nodes with `srun`, writes pdserve-<jobid>.json once every worker
serves, and on SIGTERM (scancel) stops every step."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from deploy.cluster import ROLE_NAMES
from deploy.cluster_config import load_cluster_config
from deploy.launch_checks import check_model, check_port
from deploy.ports import free_port


@dataclass(frozen=True)
class Placement:
    name: str  # worker id, or "router"
    node: str
    cmd: tuple[str, ...]


def scontrol_lines(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True,
                          text=True).stdout


def node_addr(node: str) -> str:
    """The node's address as SLURM knows it (NodeAddr), not a guess from its name."""
    for field in scontrol_lines("show", "node", node).split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    raise RuntimeError(f"scontrol show node {node}: no NodeAddr")


def gpus_on_node(env: dict[str, str]) -> int:
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()]) if visible else 0


def _int_env(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def plan(env: dict[str, str], nodes: list[str], addrs: dict[str, str],
         python: str) -> tuple[list[Placement], dict[str, Any]]:
    """Every process of the cluster and the node it runs on (pure: tested without SLURM)."""
    cfg = load_cluster_config(env["PDSERVE_CONFIG"]).values if env.get("PDSERVE_CONFIG") else {}
    pn = _int_env(env, "PDSERVE_PRODUCER_NODES", 1)
    cn = _int_env(env, "PDSERVE_CONSUMER_NODES", 1)
    zn = _int_env(env, "PDSERVE_COLOCATED_NODES", 0)
    if min(pn, cn, zn) < 0:
        raise ValueError("PDSERVE_PRODUCER_NODES/PDSERVE_CONSUMER_NODES/"
                         "PDSERVE_COLOCATED_NODES: must be >= 0")
    # a producer without a consumer (or the reverse) could never finish a request
    if (pn == 0) != (cn == 0) or pn + cn + zn == 0:
        raise ValueError("PDSERVE_PRODUCER_NODES/PDSERVE_CONSUMER_NODES: producers and "
                         "consumers come together (both >= 1, or both 0 with "
                         "PDSERVE_COLOCATED_NODES >= 1)")
    if len(nodes) < 1 + pn + cn + zn:
        names, counts = "PDSERVE_PRODUCER_NODES/PDSERVE_CONSUMER_NODES", f"{pn} + {cn}"
        if zn:
            names, counts = names + "/PDSERVE_COLOCATED_NODES", counts + f" + {zn}"
        raise ValueError(f"{names}: {counts} nodes and the router's need {1 + pn + cn + zn}; "
                         f"the job has {len(nodes)}")
    gpus = gpus_on_node(env)
    per_node = _int_env(env, "PDSERVE_WORKERS_PER_NODE", max(gpus, 1))
    devices = [d for d in cfg.get("devices", "").split(",") if d] or \
        ([f"cuda:{k}" for k in range(gpus)] if gpus else [])
    model = env.get("PDSERVE_MODEL") or cfg.get("model") or "smollm2"
    check_model(model if model != "smollm2" else None)
    host = addrs[nodes[0]]
    # this driver runs on the router's node: its ports can be checked here, before srun
    ports = []
    for var, key in (("PDSERVE_GRPC_PORT", "grpc_port"), ("PDSERVE_HTTP_PORT", "http_port")):
        port = _int_env(env, var, cfg.get(key, 0))
        check_port(var, "0.0.0.0", port)
        ports.append(port or free_port())
    grpc, http = ports
    backend = env.get("PDSERVE_TRANSFER_BACKEND") or cfg.get("transfer_backend", "ucx")
    worker_args = [*cfg.get("worker_arg", []), *shlex.split(env.get("PDSERVE_WORKER_ARGS", ""))]
    base = (python, "-m", "deploy.cli")
    out = [Placement("router", nodes[0], (*base, "router", "--host", host, "--bind-host",
                                          "0.0.0.0", "--grpc-port", str(grpc), "--http-port",
                                          str(http), "--model", model, "--policy",
                                          cfg.get("policy", "round_robin")))]
    roles = [("producer", n) for n in nodes[1:1 + pn]] + \
        [("consumer", n) for n in nodes[1 + pn:1 + pn + cn]] + \
        [("colocated", n) for n in nodes[1 + pn + cn:1 + pn + cn + zn]]
    for role, node in roles:
        for k in range(per_node):
            # the node and its slot, not the role: the router may change the role, the id stays
            wid = f"worker-{node}-{k}"
            device = ["--device", devices[k % len(devices)]] if devices else []
            out.append(Placement(wid, node, (
                *base, role, "--model", model, "--router", f"{host}:{grpc}", "--host",
                addrs[node], "--worker-id", wid, "--transfer-backend", backend, *device,
                *worker_args)))
    endpoints = {"grpc": f"{host}:{grpc}", "http": f"http://{host}:{http}"}
    return out, endpoints


def _healthy(router: str) -> dict[str, list[str]]:
    import grpc
    from pdserve.v1 import router_pb2, router_pb2_grpc

    from deploy.router_client import API_KEY_ENV, auth_metadata

    with grpc.insecure_channel(router) as ch:
        # the router step inherits $PDSERVE_API_KEY and then requires it from this call too
        status = router_pb2_grpc.RouterStub(ch).ClusterStatus(
            router_pb2.ClusterStatusRequest(), timeout=3,
            metadata=auth_metadata(os.environ.get(API_KEY_ENV, "")))
    out: dict[str, list[str]] = {"producer": [], "consumer": [], "colocated": []}
    for w in status.workers:
        if w.healthy and ROLE_NAMES.get(w.role) in out:
            out[ROLE_NAMES[w.role]].append(w.address)
    return out


def main() -> int:
    env = dict(os.environ)
    job = env["SLURM_JOB_ID"]
    nodes = scontrol_lines("show", "hostnames", env["SLURM_JOB_NODELIST"]).split()
    addrs = {n: node_addr(n) for n in nodes}
    try:
        placements, endpoints = plan(env, nodes, addrs, sys.executable)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr, flush=True)
        return 2
    os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    steps: dict[str, subprocess.Popen[bytes]] = {}
    for p in placements:
        print(f"pdserve: {p.name} on {p.node} ({addrs[p.node]})", flush=True)
        steps[p.name] = subprocess.Popen(
            ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=0",
             f"--job-name=pdserve-{p.name}", "-w", p.node, *p.cmd])
    want = len(placements) - 1
    endpoint_file = os.path.join(env.get("SLURM_SUBMIT_DIR", os.getcwd()), f"pdserve-{job}.json")
    written = False
    code = 0
    try:
        while not stop.wait(1.0):
            dead = [n for n, s in steps.items() if s.poll() is not None]
            if dead:
                print(f"pdserve: error: {dead[0]} exited (exit {steps[dead[0]].returncode}); "
                      "stopping the job", file=sys.stderr, flush=True)
                code = 1
                break
            if written:
                continue
            try:
                up = _healthy(endpoints["grpc"])
            except Exception:  # noqa: BLE001 - the router is still starting
                continue
            if sum(len(v) for v in up.values()) >= want:
                tmp = endpoint_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({**endpoints, "producers": sorted(up["producer"]),
                               "consumers": sorted(up["consumer"]),
                               "colocated": sorted(up["colocated"])}, f)
                os.replace(tmp, endpoint_file)  # readers never see half a file
                written = True
                print(f"pdserve: ready; endpoints in {endpoint_file}", flush=True)
    finally:
        stop_steps(steps)
    return code


def stop_steps(steps: dict[str, Any], wait_s: float = 30.0) -> None:
    """SIGTERM (srun forwards it to its task) to the workers first, each of which drains and
    deregisters from the router, then to the router: stopped first, it would leave every
    worker unable to deregister. A step that outlives ``wait_s`` is killed."""
    for group in ([s for n, s in steps.items() if n != "router"],
                  [s for n, s in steps.items() if n == "router"]):
        for s in group:
            if s.poll() is None:
                s.send_signal(signal.SIGTERM)
        end = time.monotonic() + wait_s
        for s in group:
            try:
                s.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait(10)


if __name__ == "__main__":
    sys.exit(main())
