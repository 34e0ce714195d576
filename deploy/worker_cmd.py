"""`pdserve producer|consumer|colocated`: one worker service per command, for launchers
that place each role on its own host. The command names the worker's first role; every
role's parts are handed to the worker, since the router may order a role change
(worker/runner.py rebuilds the worker in place)."""

from __future__ import annotations

import argparse
import functools
import math
import os
import uuid
from typing import Any

from consumer.role import make_colocated_handler, make_consumer_handler
from consumer.servicer import ConsumerServicer
from deploy.cpu_threads import engine_threads, passive_omp_waits
from deploy.engine_args import add_engine_args, engine_config
from deploy.event_loop import EVENT_LOOPS, resolve_event_loop, run_on
from producer.role import make_producer_handler
from producer.servicer import ProducerServicer
from transfer.types import BACKENDS
from worker.drain import DEFAULT_DRAIN_TIMEOUT_S
from worker.engine_loop import EngineSpec, HandlerFactory
from worker.servicer import WorkerServicer

ROLE_HELP = {"producer": "a prefill worker (direct output; pushes KV to consumers)",
             "consumer": "a decode worker (reserves blocks, receives KV, deferred output)",
             "colocated": "a worker running both phases on one engine"}

# What each command runs: the engine-process handler and the gRPC servicer of its role.
ROLE_PARTS: dict[str, tuple[HandlerFactory, type[WorkerServicer]]] = {
    "producer": (make_producer_handler, ProducerServicer),
    "consumer": (make_consumer_handler, ConsumerServicer),
    "colocated": (make_colocated_handler, ConsumerServicer),
}


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    g = p.add_argument_group("service")
    g.add_argument("--router", required=True, help="the router's gRPC address, host:port")
    g.add_argument("--host", default="127.0.0.1", help="bind address of this worker's gRPC")
    g.add_argument("--advertise-host", default="",
                   help="address peers dial (default: --host); set when binding 0.0.0.0")
    g.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    g.add_argument("--worker-id", default="",
                   help="the worker's name at the router (default: worker-<random>; no role "
                        "in it, since the router may change the role)")
    g.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""),
                   help="shared secret to join the router and to push KV into consumers "
                        "(default: $PDSERVE_CLUSTER_TOKEN)")
    g.add_argument("--router-ca", default="",
                   help="PEM CA certificate of a TLS router (its --tls-cert); default plaintext")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port on --host (0: any free port, logged; -1: off)")
    g.add_argument("--outputs-port", type=int, default=0,
                   help="port on --host of the Outputs stream over plain TCP, which the "
                        "router reads each step's tokens from at less CPU than the gRPC "
                        "stream (0: any free port, advertised at registration; -1: off, the "
                        "router reads the gRPC stream, and --no-outputs-unix is implied). "
                        "Open it to the router like --port")
    g.add_argument("--no-outputs-unix", dest="outputs_unix", action="store_false",
                   help="serve the Outputs stream on TCP only. By default (Linux) it is also "
                        "served on an abstract Unix socket with a random name, advertised at "
                        "registration: a router on this host (and network namespace) reads "
                        "that, at less CPU per step on both ends than loopback TCP; any other "
                        "router cannot reach it and reads the TCP port")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads of the engine process (default 0: the cores this "
                        "process may use, cgroup quota and affinity included)")
    g.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                   help="the gRPC process's event loop: uvloop costs less CPU per wake-up "
                        "(each engine step's message, each Outputs write); auto: uvloop "
                        "when installed, else asyncio's")
    g.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM (and before a role change) the worker deregisters, takes "
                        "no new requests and lets those in flight finish for up to this many "
                        "seconds; any still running then end with an error. SIGTERM then "
                        "exits 0. Give a pod's terminationGracePeriodSeconds a little more")
    # Every role takes every role's flags: the router may change a worker's role, and the
    # worker then runs the new role with the flags it was started with.
    t = p.add_argument_group("KV transfer (producer and consumer)")
    t.add_argument("--transfer-backend", default="ucx", choices=BACKENDS,
                   help="ucx: any hosts (TCP, shared memory, cuda_ipc); nixl: RDMA between "
                        "hosts; ipc: one host only, the consumer maps the producer's pool")
    t.add_argument("--kv-host", default="",
                   help="consumer: address its KV receiver binds and advertises "
                        "(default: --advertise-host or --host)")
    t.add_argument("--kv-port", type=int, default=0)
    t.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds a transfer may take before it fails")
    t.add_argument("--peer-timeout", type=float, default=5.0,
                   help="seconds of silence after which a transfer peer is dead (<= 10)")
    r = p.add_argument_group("per role (used while the worker has that role)")
    r.add_argument("--reservation-timeout", type=float, default=600.0,
                   help="consumer: seconds reserved blocks wait for the producer's KV (the "
                        "request may queue behind other prompts there first)")
    r.add_argument("--lease", type=float, default=30.0,
                   help="producer: seconds blocks are held waiting for a consumer's "
                        "destination; at least 2x the router's --hold-interval (the router "
                        "refuses a shorter one)")
    r.add_argument("--no-launch-pacing", dest="launch_pacing", action="store_false",
                   help="consumer: launch each decode step as soon as the last one's tokens "
                        "are read, even while KV transfers are in flight (by default the "
                        "launch waits until shortly before the running step ends, so that "
                        "requests whose KV lands meanwhile join it: worker/launch_pacer.py)")
    r.add_argument("--defer-output", action="store_true",
                   help="producer, FOR BENCHMARKS ONLY: defer the producer's output like a "
                        "decode engine, to measure what direct output saves")


def spec_from_args(args: argparse.Namespace, role: str) -> EngineSpec:
    overrides: dict[str, Any] = {"role": role}
    if role == "producer" and args.defer_output:
        overrides["defer_output"] = True
    transfer: dict[str, Any] = {}
    if role != "colocated":
        transfer = {"backend": args.transfer_backend,
                    "host": args.kv_host or args.advertise_host or args.host,
                    "port": args.kv_port, "transfer_timeout_s": args.transfer_timeout,
                    "peer_timeout_s": args.peer_timeout,
                    "heartbeat_interval_s": min(1.0, args.peer_timeout / 2),
                    "cluster_token": args.cluster_token}
    return EngineSpec(role=role, engine=engine_config(args, **overrides),
                      handler_factory=ROLE_PARTS[role][0], transfer=transfer,
                      threads=engine_threads(args.threads), lease_s=args.lease,
                      reservation_s=args.reservation_timeout,
                      launch_pacing=args.launch_pacing)


def worker_id(args: argparse.Namespace) -> str:
    """The id given, else a role-neutral one: the id outlives a role change (the router and
    peers keep using it), so a role in it would be wrong after the first change."""
    return args.worker_id or f"worker-{uuid.uuid4().hex[:6]}"


def run_worker_cmd(args: argparse.Namespace) -> int:
    from worker.runner import run_worker_roles
    from worker.server import WorkerConfig

    for flag, v in (("--drain-timeout", args.drain_timeout), ("--lease", args.lease),
                    ("--reservation-timeout", args.reservation_timeout)):
        if not 0 < v < math.inf:  # a NaN fails too
            raise ValueError(f"{flag}: must be a number of seconds > 0, got {v}")

    def config_for(role: str) -> WorkerConfig:
        return WorkerConfig(spec=spec_from_args(args, role), servicer=ROLE_PARTS[role][1],
                            router=args.router,
                            bind_host=args.host, advertise_host=args.advertise_host,
                            port=args.port, worker_id=args.worker_id,
                            cluster_token=args.cluster_token, metrics_port=args.metrics_port,
                            router_ca=args.router_ca, outputs_port=args.outputs_port,
                            outputs_unix=args.outputs_unix)

    args.worker_id = worker_id(args)
    config_for(args.command)  # bad flags fail here, before anything starts
    passive_omp_waits()  # inherited by the engine process, which loads torch
    resolve_event_loop(args.event_loop)  # a missing uvloop fails here, before any start
    return run_worker_roles(config_for, args.command, args.drain_timeout,
                            run=functools.partial(run_on, args.event_loop))


def add_worker_parsers(sub: Any) -> None:
    for role, help_text in ROLE_HELP.items():
        p = sub.add_parser(role, help=help_text)
        add_worker_args(p, role)
        p.set_defaults(func=run_worker_cmd)
