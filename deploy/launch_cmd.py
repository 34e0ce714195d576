"""`pdserve launch`: a whole xPyD cluster on this machine, in the foreground."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
from typing import Any

from deploy.cluster import ROLE_NAMES, ClusterSpec, ClusterStartError, LocalCluster
from deploy.cluster_config import apply_config, load_cluster_config
from deploy.engine_args import add_engine_args, engine_flag_args
from deploy.launch_checks import check_devices, check_host, check_model, check_port
from deploy.supervisor import RouterExited, Supervisor
from router.config import POLICY_NAMES
from transfer.types import BACKENDS


def add_launch_parser(sub: Any) -> None:
    p = sub.add_parser("launch", help="start a local cluster: router + producers + consumers")
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--consumers", type=int, default=1)
    p.add_argument("--colocated", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP port (0: a free port; -1: off)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                   help="clients must send it as 'Bearer <key>' (default: $PDSERVE_API_KEY)")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""),
                   help="shared secret of router and workers (default: $PDSERVE_CLUSTER_TOKEN, "
                        "else a random one for this cluster)")
    p.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES,
                   help="the router's placement policy (pdserve router --help)")
    p.add_argument("--transfer-backend", default="ucx", choices=BACKENDS,
                   help="ucx: any hosts (TCP, shared memory, cuda_ipc); nixl: RDMA between "
                        "hosts; ipc: one host only, the consumer maps the producer's pool")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (default 0: the cores this process may "
                        "use, cgroup quota and affinity included, split among the workers)")
    p.add_argument("--devices", default="",
                   help="comma-separated devices (cpu, cuda:0, ...) cycled over producers, "
                        "then consumers, then colocated workers: each gets --device")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks per worker (producers, consumers, colocated); each worker "
                        "uses consecutive devices from its --device")
    p.add_argument("--log-dir", default=None, help="write each process's output there")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--max-num-seqs=32")
    p.add_argument("--config", default=None,
                   help="a cluster.yaml (model, workers, devices, ports, engine flags, "
                        "policies); flags given on the command line win")
    # Every engine flag, passed on to each worker; launch's own --model (router too),
    # --devices (one per worker, cycled) and --tensor-parallel-size stand for the engine's.
    add_engine_args(p, skip=("--model", "--devices", "--tensor-parallel-size"))
    p.set_defaults(func=run_launch, launch_defaults={
        a.dest: a.default for a in p._actions if a.dest != "help"})


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The cluster the flags describe, checked before anything starts (ValueError names the
    flag)."""
    if args.config:
        apply_config(args, args.launch_defaults, load_cluster_config(args.config))
    devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    check_devices(devices)
    if args.threads < 0:
        raise ValueError(f"threads: must be >= 0, got {args.threads}")
    check_host(args.host)
    check_port("grpc-port", args.host, args.grpc_port)
    check_port("http-port", args.host, args.http_port, allow_off=True)
    if args.grpc_port and args.grpc_port == args.http_port:
        raise ValueError(f"http-port: {args.http_port} is also the gRPC port")
    check_model(args.model)
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size: must be >= 1, got {tp}")
    tp_args = (f"--tensor-parallel-size={tp}",) if tp > 1 else ()
    # Its own cluster gets its own secret: workers refuse calls from outside it.
    token = args.cluster_token or secrets.token_hex(16)
    engine = engine_flag_args(args, args.launch_defaults)
    return ClusterSpec(producers=args.producers, consumers=args.consumers,
                       colocated=args.colocated, model=args.model, host=args.host,
                       grpc_port=args.grpc_port, http_port=args.http_port, policy=args.policy,
                       transfer_backend=args.transfer_backend, threads=args.threads,
                       worker_args=(*args.worker_arg, *engine, *tp_args), api_key=args.api_key,
                       cluster_token=token, devices=devices)


def run_launch(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    cluster = LocalCluster(spec, log_dir=args.log_dir, quiet_start=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("starting the cluster (model loading takes a few seconds)...", flush=True)
    try:
        try:
            cluster.start()
        except ClusterStartError as e:
            print(f"pdserve: error: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"router gRPC:  {cluster.router_address}", flush=True)
        if cluster.http_port > 0:
            print(f"router HTTP:  http://{args.host}:{cluster.http_port}/v1", flush=True)
            print(f"router metrics: http://{args.host}:{cluster.http_port}/metrics", flush=True)
        for w in cluster.status().workers:
            mport = cluster.metrics_ports.get(w.worker_id)
            metrics = f"  metrics :{mport}" if mport else ""
            print(f"  {ROLE_NAMES.get(w.role, '?'):9s} {w.worker_id:14s} {w.address}  "
                  f"KV blocks {w.load.kv_blocks_free}/{w.load.kv_blocks_total}{metrics}",
                  flush=True)
        print("ready; Ctrl-C stops every process", flush=True)
        supervisor = Supervisor(cluster, say=lambda m: print(m, flush=True))
        while not stop.wait(0.5):
            try:
                supervisor.poll()
            except RouterExited as e:
                print(f"pdserve: error: {e}; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        cluster.stop()
