"""``pdserve plan apply``: move a running cluster to a split (the router's Admin.ChangeSplit),
printing each step as the router reports it. The router picks which workers change and
drains each before it changes role; no request is lost."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from deploy.router_client import add_router_client_args, auth_metadata, channel, error_line

ROLE_WORDS = {1: "producer", 2: "consumer", 3: "colocated"}


def add_apply_parser(ps: Any) -> None:
    a = ps.add_parser("apply", help="move a running cluster to a new split, live",
                      description="Asks the router to change workers' roles until the cluster "
                                  "has this split; each changing worker drains first.")
    a.add_argument("--router", required=True, help="the router's gRPC address, host:port")
    a.add_argument("--producers", type=int, required=True)
    a.add_argument("--consumers", type=int, required=True)
    a.add_argument("--colocated", type=int, default=0)
    add_router_client_args(a)
    a.add_argument("--step-timeout", type=float, default=0.0,
                   help="seconds one worker's change (drain, rebuild, re-register) may take "
                        "(0: the router's default, 300)")
    a.set_defaults(func=run_apply)


def run_apply(args: argparse.Namespace) -> int:
    import grpc
    from pdserve.v1 import router_pb2, router_pb2_grpc

    for flag in ("producers", "consumers", "colocated"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag}: must be >= 0, got {getattr(args, flag)}")
    if args.step_timeout < 0:
        raise ValueError(f"--step-timeout: must be >= 0, got {args.step_timeout}")
    metadata = auth_metadata(args.api_key)
    error = "the router ended the change without a final message"
    with channel(args.router, args.router_ca) as ch:
        stub = router_pb2_grpc.AdminStub(ch)
        try:
            for msg in stub.ChangeSplit(router_pb2.ChangeSplitRequest(
                    producers=args.producers, consumers=args.consumers,
                    colocated=args.colocated, step_timeout_s=args.step_timeout),
                    metadata=metadata):
                print(msg.message, flush=True)
                if msg.done:
                    error = msg.error
        except grpc.RpcError as e:
            error = error_line(args.router, e)
    if error:
        print(f"pdserve: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0
