"""`pdserve router`: the cluster's front door, in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from typing import Any

from deploy.event_loop import EVENT_LOOPS, resolve_event_loop, run_on
from router.config import POLICY_NAMES, RouterConfig
from worker.heap import freeze_startup_heap, space_full_collections


def add_router_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="run the router (gRPC API, worker registry, pairing)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address clients and workers dial (advertised)")
    p.add_argument("--bind-host", default=None,
                   help="address to bind (default: --host; 0.0.0.0 for every interface)")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--model", default=None,
                   help="model the workers serve, for the tokenizer (default: embedded smollm2)")
    p.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES,
                   help="cache_aware: the worker with the fewest prompt tokens to compute (a "
                        "consumer: to receive) beyond the prefix its cache holds, by the "
                        "workers' KV events, plus its load priced in tokens")
    p.add_argument("--cache-load-tokens", type=float, default=512.0,
                   help="cache_aware: prefill tokens one queued request's worth of load "
                        "costs (higher: balance load more, follow cached prefixes less)")
    p.add_argument("--cache-imbalance", type=float, default=8.0,
                   help="cache_aware: when the cache's pick is this much more loaded (queued "
                        "requests) than the least loaded worker, the least loaded takes it")
    p.add_argument("--local-prefill-max-tokens", type=int, default=64,
                   help="cache_aware: a consumer prefills a prompt itself (no producer, no "
                        "transfer) when the tokens its cache lacks are at most this many and "
                        "either it holds a cached prefix or every producer has a queue and "
                        "it has room; -1: never")
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="seconds between worker heartbeats (told to workers)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="drop a worker silent this many seconds")
    p.add_argument("--busy-lag", type=float, default=2.0,
                   help="a worker whose heartbeats report its event loop this many seconds "
                        "behind is busy: it keeps its requests but gets no new ones (0: off)")
    p.add_argument("--busy-engine-age", type=float, default=10.0,
                   help="the same for a worker whose engine's last load report is this many "
                        "seconds old (0: off)")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""),
                   help="shared secret workers must present (default: $PDSERVE_CLUSTER_TOKEN, "
                        "else none)")
    p.add_argument("--token0-timeout", type=float, default=600.0,
                   help="seconds to wait for a leg's first token before failing the request")
    p.add_argument("--token-timeout", type=float, default=300.0,
                   help="seconds to wait for a leg's next message before failing the request")
    p.add_argument("--hold-interval", type=float, default=1.0,
                   help="seconds between the router's word to a producer that the consumer's "
                        "reservation still waits for blocks (renews the producer's --lease)")
    p.add_argument("--abort-timeout", type=float, default=2.0,
                   help="deadline of Abort calls to workers")
    p.add_argument("--prefill-retries", type=int, default=2,
                   help="times a request whose producer fails before token 0 is placed again")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="times a request a worker failed later (e.g. a consumer dying "
                        "mid-decode) moves to another worker with the tokens streamed so far")
    f = p.add_argument_group("front door")
    f.add_argument("--http-port", type=int, default=-1,
                   help="OpenAI-compatible HTTP port (0: a free port; -1: off)")
    f.add_argument("--grpc-stream-port", type=int, default=-1,
                   help="a second gRPC port serving Router/Generate only, its messages framed "
                        "by hand: less router CPU per streamed token than the main gRPC port "
                        "(0: a free port; -1: off)")
    f.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                   help="clients must send 'Authorization: Bearer <key>' on HTTP /v1/* and "
                        "gRPC Router calls (default: $PDSERVE_API_KEY, else no check)")
    f.add_argument("--tls-cert", default="", help="PEM certificate: serve HTTPS and gRPC TLS")
    f.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    f.add_argument("--max-running-requests", type=int, default=512,
                   help="requests dispatched to workers at once; more wait in the queue")
    f.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting for a running slot; more get 429/RESOURCE_EXHAUSTED")
    f.add_argument("--retry-after", type=float, default=1.0,
                   help="seconds clients are told to wait after an overload refusal")
    f.add_argument("--frontends", type=int, default=1,
                   help="router processes serving the same ports (SO_REUSEPORT), for more "
                        "streamed tokens/s than one process gives and a shorter first-token "
                        "tail at hundreds of streams; one keeps the workers' registry, the "
                        "others mirror it (needs a fixed --grpc-port)")
    f.add_argument("--primary", default="", help=argparse.SUPPRESS)  # set in mirrors only
    # the primary's pid, in mirrors only: a mirror ends with it (die_with_primary)
    f.add_argument("--primary-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                   help="the process's event loop: uvloop costs less CPU per streamed "
                        "message; auto: uvloop when installed, else asyncio's")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_router)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, bind_host=args.bind_host, grpc_port=args.grpc_port,
                        model=args.model, policy=args.policy,
                        cache_load_tokens=args.cache_load_tokens,
                        cache_imbalance=args.cache_imbalance,
                        local_prefill_max_tokens=args.local_prefill_max_tokens,
                        heartbeat_interval_s=args.heartbeat_interval,
                        heartbeat_timeout_s=args.heartbeat_timeout,
                        busy_lag_s=args.busy_lag, busy_engine_s=args.busy_engine_age,
                        cluster_token=args.cluster_token, token0_timeout_s=args.token0_timeout,
                        token_timeout_s=args.token_timeout, abort_timeout_s=args.abort_timeout,
                        http_port=args.http_port, grpc_stream_port=args.grpc_stream_port,
                        api_key=args.api_key, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, max_running_requests=args.max_running_requests,
                        max_queued_requests=args.max_queued_requests,
                        retry_after_s=args.retry_after, prefill_retries=args.prefill_retries,
                        max_migrations=args.max_migrations,
                        hold_interval_s=args.hold_interval, frontends=args.frontends,
                        primary=args.primary)


def run_router(args: argparse.Namespace) -> int:
    if args.primary_pid:  # first: before this process starts any thread
        die_with_primary(args.primary_pid)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = router_config(args)
    try:
        resolve_event_loop(args.event_loop)
    except ValueError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    return run_on(args.event_loop, _serve(cfg))


async def _serve(cfg: RouterConfig) -> int:
    from router.server import RouterServer, host_port  # after arg parsing: --help is instant

    server = RouterServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    mirrors = start_mirrors(cfg, server) if cfg.frontends > 1 else []
    # every stream waits out a full collection's walk of what start-up built; none needs to
    freeze_startup_heap()
    space_full_collections()  # a burst of requests walks their live state a tenth as often
    print(f"pdserve router: gRPC {server.address} (policy {cfg.policy})"
          + (f", {cfg.frontends} frontends" if mirrors else ""), flush=True)
    if server.http_port:
        scheme = "https" if cfg.tls_cert else "http"
        print(f"pdserve router: HTTP {scheme}://{host_port(cfg.host, server.http_port)}/v1",
              flush=True)
    if server.grpc_stream_port:
        print("pdserve router: gRPC Generate stream "
              f"{host_port(cfg.host, server.grpc_stream_port)}", flush=True)
    try:
        await stop.wait()
    finally:
        print("pdserve router: shutting down", file=sys.stderr, flush=True)
        for m in mirrors:
            m.terminate()
        await server.stop()
        for m in mirrors:
            try:
                m.wait(10)
            except subprocess.TimeoutExpired:
                m.kill()
    return 0


def start_mirrors(cfg: RouterConfig, server: Any) -> list[subprocess.Popen[bytes]]:
    """The other frontends (router/control/frontends.py): this command again, on the ports this
    process bound, told where the primary's registry is. Each dies with this process, which
    it arranges itself (``die_with_primary``): no Python runs between fork and exec here,
    so the child is started with vfork and exec at once. A ``preexec_fn`` meant a fork of
    this process while its gRPC threads ran (gRPC's log: "Other threads are currently
    calling into gRPC, skipping fork() handlers") and Python in the child before exec;
    twice in five full CPU suites the mirror was found dead at start-up (sessions 25 and
    27, tests/e2e/test_frontends.py), the second time with that line in its log."""
    argv = [*sys.argv[1:], "--frontends", "1", "--primary", server.internal_address,
            "--primary-pid", str(os.getpid()), "--grpc-port", str(server.port)]
    if server.http_port:
        argv += ["--http-port", str(server.http_port)]
    if server.grpc_stream_port:
        argv += ["--grpc-stream-port", str(server.grpc_stream_port)]
    return [subprocess.Popen([sys.executable, "-m", "deploy.cli", *argv])
            for _ in range(cfg.frontends - 1)]


def die_with_primary(primary_pid: int) -> None:
    """A mirror gets SIGTERM when the primary's main thread (the one that started it) ends,
    and exits now if the primary already has: its sockets would serve a registry that no
    longer exists."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != primary_pid:  # it died before the line above (we were reparented)
        print(f"pdserve router: the primary router (pid {primary_pid}) is gone; this mirror "
              "frontend exits", file=sys.stderr, flush=True)
        sys.exit(1)
