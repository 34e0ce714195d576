"""`pdserve router`: the cluster's front door, in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from router.config import POLICY_NAMES, RouterConfig


def add_router_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="run the router (gRPC API, worker registry, pairing)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address clients and workers dial (advertised)")
    p.add_argument("--bind-host", default=None,
                   help="address to bind (default: --host; 0.0.0.0 for every interface)")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--model", default=None,
                   help="model the workers serve, for the tokenizer (default: embedded smollm2)")
    p.add_argument("--policy", default="least_loaded", choices=POLICY_NAMES)
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between worker heartbeats (told to workers)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="drop a worker silent this many seconds")
    p.add_argument("--cluster-token", default="",
                   help="shared secret workers must present (default: none)")
    p.add_argument("--token0-timeout", type=float, default=600.0,
                   help="seconds to wait for a leg's first token before failing the request")
    p.add_argument("--token-timeout", type=float, default=300.0,
                   help="seconds to wait for a leg's next message before failing the request")
    p.add_argument("--abort-timeout", type=float, default=2.0,
                   help="deadline of Abort calls to workers")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_router)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, bind_host=args.bind_host, grpc_port=args.grpc_port,
                        model=args.model, policy=args.policy,
                        heartbeat_interval_s=args.heartbeat_interval,
                        heartbeat_timeout_s=args.heartbeat_timeout,
                        cluster_token=args.cluster_token, token0_timeout_s=args.token0_timeout,
                        token_timeout_s=args.token_timeout, abort_timeout_s=args.abort_timeout)


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = router_config(args)
    return asyncio.run(_serve(cfg))


async def _serve(cfg: RouterConfig) -> int:
    from router.server import RouterServer  # after arg parsing: --help stays instant

    server = RouterServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"pdserve router: gRPC {server.address} (policy {cfg.policy})", flush=True)
    try:
        await stop.wait()
    finally:
        print("pdserve router: shutting down", file=sys.stderr, flush=True)
        await server.stop()
    return 0
