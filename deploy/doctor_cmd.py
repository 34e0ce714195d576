"""`pdserve doctor`: a node's preflight, or with --router a running cluster's."""

from __future__ import annotations

import argparse
from typing import Any

from deploy.doctor import clock_checks, cluster_checks, env_api_key, exit_code, node_checks, render


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="preflight checks of this node (and a running cluster)")
    p.add_argument("--router", default="", help="also check the cluster of this router")
    p.add_argument("--api-key", default=env_api_key(),
                   help="the router's API key (default: $PDSERVE_API_KEY)")
    p.add_argument("--http", default="",
                   help="the router's HTTP base URL: also checks clock skew against it")
    p.add_argument("--skip-node", action="store_true", help="only the cluster checks")
    p.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    checks = [] if args.skip_node else node_checks()
    if args.router:
        checks += cluster_checks(args.router, args.api_key)
    if args.http:
        checks += clock_checks(args.http)
    print(render(checks), flush=True)
    return exit_code(checks)
