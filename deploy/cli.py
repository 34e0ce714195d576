"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deploy.bench_cmd import add_bench_parser
from deploy.cluster import ClusterStartError
from deploy.doctor_cmd import add_doctor_parser
from deploy.generate_cmd import add_generate_parser
from deploy.launch_cmd import add_launch_parser
from deploy.plan_cmd import add_plan_parser
from deploy.router_client import RouterError
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
    _show_defaults(parser)
    return parser


SECRETS = ("api_key", "cluster_token")  # defaults from the environment: never printed


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help shows each flag's default (subcommands' too), except where
    the help already says it, where there is nothing to show, and for secrets."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)
            continue
        text = action.help or ""
        d = action.default
        if (not action.option_strings or text == argparse.SUPPRESS
                or "default" in text.lower() or action.dest in SECRETS or d is None
                or d == "" or d == [] or d is argparse.SUPPRESS or isinstance(d, bool)):
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except (RouterError, ClusterStartError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
