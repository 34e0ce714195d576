"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each command's module and the function that adds its subparser(s), in --help's order.
# The modules are imported where the parser is built, not at this module's import: a
# worker's engine process is started with multiprocessing's spawn, which runs the parent's
# main module (this one, under `python -m deploy.cli`) again in the child before anything
# else, and top-level imports here cost every engine start and role change 0.85 s of CPU
# that the engine never uses. A process started for one command (a worker, the router)
# builds that command's parser alone: the others' modules (plan's simulator and numpy,
# launch's supervisor, ...) cost a worker's gRPC process ~0.6 s of its start.
COMMANDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("deploy.generate_cmd", "add_generate_parser", ("generate",)),
    ("deploy.worker_cmd", "add_worker_parsers", ("producer", "consumer", "colocated")),
    ("deploy.router_cmd", "add_router_parser", ("router",)),
    ("deploy.launch_cmd", "add_launch_parser", ("launch",)),
    ("deploy.bench_cmd", "add_bench_parser", ("bench",)),
    ("deploy.doctor_cmd", "add_doctor_parser", ("doctor",)),
    ("deploy.plan_cmd", "add_plan_parser", ("plan",)),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` (a subcommand's name) only the module
    that defines it (what a process started for that one command needs)."""
    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    only = [c for c in COMMANDS if command in c[2]]
    for module, add, _ in only or COMMANDS:
        getattr(importlib.import_module(module), add)(sub)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # imported here: deploy.cluster (grpc, the router's protos) is a worker's import
        # only where it fails
        from deploy.cluster import ClusterStartError
        from deploy.router_client import RouterError

        if not isinstance(e, (RouterError, ClusterStartError)):
            raise
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
