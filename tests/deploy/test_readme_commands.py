"""Every `pdserve` command in the README's and the deployment guide's shell blocks parses
with the CLI as it is (a renamed or missing flag fails here, not in a user's terminal).
The commands that run on one machine were also run as written; the multi-node
ones name hosts that exist only in the example."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from deploy.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/deployment.md")


def _commands(doc: str) -> list[str]:
    text = (REPO / doc).read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            cmd = line.split("#", 1)[0].strip()
            cmd = cmd.split("&&")[-1].strip()  # "./setup.sh && .venv/bin/pdserve launch"
            for prefix in (".venv/bin/pdserve ", "pdserve "):
                if cmd.startswith(prefix):
                    out.append(cmd[len(prefix):])
    return out


CASES = [(doc, cmd) for doc in DOCS for cmd in _commands(doc)]


def test_the_docs_have_commands() -> None:
    assert len(_commands("README.md")) >= 10


@pytest.mark.parametrize("doc, cmd", CASES, ids=[f"{d}:{c[:40]}" for d, c in CASES])
def test_every_documented_command_parses(doc: str, cmd: str) -> None:
    argv = [a.replace("<pid of worker-0>", "1") for a in shlex.split(cmd)]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}: `pdserve {cmd}` does not parse (exit {e.code})")
