"""CPU time of a local cluster's processes, from /proc: per process group, split into the
router, each worker's service (gRPC) process, its engine process and its helpers.

/proc CPU times count in clock ticks (10 ms where CLK_TCK is 100): measured windows of a few
seconds or more keep that rounding under a percent. Linux only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of one process in seconds (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def group_pids(pgid: int) -> list[int]:
    """Live processes of one process group (a cluster process and what it spawned)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return sorted(out)


def proc_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


# worker/heartbeat_process.py's PROCESS_NAME (not imported: this module stays free of the
# worker's gRPC imports)
HEARTBEAT_COMM = "pdserve-hbeat"


def role_of(pid: int, leader: int, name: str) -> str:
    """Which part of a cluster process a pid is: the router, a worker's service (its gRPC
    process, the group leader), its heartbeat process, its engine (spawned ranks), a
    transfer data-plane process, or a helper."""
    if name.startswith("router"):  # "router", or a front door started apart ("router-1")
        return "router"
    if pid == leader:
        return "service"
    if proc_comm(pid) == HEARTBEAT_COMM:
        return "heartbeat"
    cmd = proc_cmdline(pid)
    if "resource_tracker" in cmd or "forkserver" in cmd:
        return "helper"
    if "transfer." in cmd:  # a transfer backend's own data-plane process
        return "transfer"
    return "engine"


@dataclass
class CpuSnapshot:
    at: float  # time.monotonic()
    cpu: dict[int, float]  # pid -> cpu seconds
    # pid -> "router" (its processes, frontends included) | "router-N" | "<worker>/service" |
    # "<worker>/heartbeat" | "<worker>/engine" | "<worker>/transfer" | "<worker>/helper"
    part: dict[int, str]


def snapshot(groups: dict[str, int]) -> CpuSnapshot:
    """groups: cluster process name -> its pid (= its process group id)."""
    cpu, part = {}, {}
    for name, leader in groups.items():
        for pid in group_pids(leader):
            t = proc_cpu_s(pid)
            if t is not None:
                cpu[pid] = t
                role = role_of(pid, leader, name)
                part[pid] = name if role == "router" else f"{name}/{role}"
    return CpuSnapshot(time.monotonic(), cpu, part)


def cpu_between(a: CpuSnapshot, b: CpuSnapshot) -> dict[str, dict[str, Any]]:
    """CPU seconds per part over [a, b]; a process born in between counts from 0."""
    parts: dict[str, dict[str, Any]] = {}
    for pid, end in b.cpu.items():
        p = parts.setdefault(b.part[pid], {"cpu_s": 0.0, "procs": []})
        used = end - a.cpu.get(pid, 0.0)
        p["cpu_s"] += used
        p["procs"].append({"pid": pid, "cpu_s": round(used, 3),
                           "cmd": proc_cmdline(pid)[:160]})
    return parts
