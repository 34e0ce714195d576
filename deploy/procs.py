"""The machine's process table from /proc (Linux): what the launcher and the test suite use
to check that no process outlives what started it."""

from __future__ import annotations

import os
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    state: str  # "R", "S", "D", "Z" (zombie: exited, not yet reaped), ...
    ppid: int
    pgrp: int


def processes() -> list[Proc]:
    """Every process readable now (one that exits while being read is left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces or parens: split after its last ')'
        state, ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        out.append(Proc(int(entry), state, int(ppid), int(pgrp)))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(exited)"
