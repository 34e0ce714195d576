"""`pdserve doctor`: a node's preflight, or with --router a running cluster's."""

from __future__ import annotations

import argparse
from typing import Any

from deploy.doctor import clock_checks, cluster_checks, exit_code, node_checks, render
from deploy.router_client import add_router_client_args


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="preflight checks of this node (and a running cluster)")
    p.add_argument("--router", default="", help="also check the cluster of this router")
    add_router_client_args(p)
    p.add_argument("--http", default="",
                   help="the router's HTTP base URL: also checks clock skew against it")
    p.add_argument("--skip-node", action="store_true", help="only the cluster checks")
    p.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    checks = [] if args.skip_node else node_checks()
    if args.router:
        checks += cluster_checks(args.router, args.api_key, router_ca=args.router_ca)
    if args.http:
        checks += clock_checks(args.http)
    print(render(checks), flush=True)
    return exit_code(checks)
