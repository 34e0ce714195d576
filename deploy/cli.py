"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.bench_cmd import add_bench_parser
from deploy.doctor_cmd import add_doctor_parser
from deploy.generate_cmd import add_generate_parser
from deploy.launch_cmd import add_launch_parser
from deploy.plan_cmd import add_plan_parser
from deploy.router_cmd import add_router_parser
from deploy.worker_cmd import add_worker_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_worker_parsers(sub)
    add_router_parser(sub)
    add_launch_parser(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
