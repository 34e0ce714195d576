"""`deploy.cli` stays cheap to import, and a process started for one command builds that
command's parser alone.

A worker's engine process is started with multiprocessing's spawn, which runs the parent's
main module (`python -m deploy.cli`) again in the child before the engine starts: whatever
deploy.cli imports at its top is paid again by every engine start and role change. And a
worker or router process does not need the other commands' modules (plan's simulator and
numpy, launch's supervisor) to parse its own flags. Each check runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_COMMANDS = ("deploy.plan_cmd", "deploy.launch_cmd", "deploy.bench_cmd",
                  "deploy.doctor_cmd", "deploy.generate_cmd")


def _loaded(code: str, names: tuple[str, ...]) -> list[str]:
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps([n for n in {names!r} if n in sys.modules]))")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT}/proto")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def test_importing_the_cli_imports_no_command() -> None:
    heavy = ("deploy.worker_cmd", "deploy.router_cmd", "deploy.cluster", "numpy", "grpc",
             "aiohttp", *OTHER_COMMANDS)
    assert _loaded("import deploy.cli", heavy) == []


@pytest.mark.parametrize("argv,needed", [
    (["producer", "--router", "127.0.0.1:1"], "deploy.worker_cmd"),
    (["router"], "deploy.router_cmd"),
])
def test_one_commands_parser_imports_only_its_module(argv: list[str], needed: str) -> None:
    code = f"from deploy.cli import build_parser\nbuild_parser({argv[0]!r}).parse_args({argv!r})"
    assert _loaded(code, (needed, *OTHER_COMMANDS)) == [needed]


def test_the_whole_parser_still_has_every_command() -> None:
    from deploy.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = [n for _, _, ns in COMMANDS for n in ns]
    assert list(sub.choices) == names  # type: ignore[attr-defined]
    assert {"plan", "launch", "producer", "router", "bench", "doctor", "generate"} <= set(names)
