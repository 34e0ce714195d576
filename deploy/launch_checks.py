"""What `pdserve launch` checks before it starts anything: every mistake it can see up front
(ports, devices, the model) is one clear error naming the flag, not a process that dies
half-way through start-up."""

from __future__ import annotations

import re
import socket

from deploy.ports import bind_error
from engine.model_source import resolve_model

DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def check_port(flag: str, host: str, port: int, allow_off: bool = False) -> None:
    """A port the launcher will bind: in range, and free now (0 picks a free one later)."""
    low = -1 if allow_off else 0
    if not low <= port <= 65535:
        off = "; -1: off" if allow_off else ""
        raise ValueError(f"{flag}: {port} is not a port (0-65535; 0: a free port{off})")
    if port <= 0:
        return
    if (why := bind_error(host, port)) is not None:
        raise ValueError(f"{flag}: cannot bind {host}:{port} ({why})")


def check_host(host: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise ValueError(f"host: {host!r} does not resolve ({e})") from None


def check_devices(devices: tuple[str, ...]) -> None:
    for d in devices:
        if not DEVICE_RE.match(d):
            raise ValueError(f"devices: {d!r} is not a device (cpu, auto, cuda, cuda:N)")


def check_model(model: str | None) -> None:
    resolve_model(model)  # raises ValueError("model: ...") naming what it tried


def worker_names(producers: int, consumers: int, colocated: int) -> list[tuple[str, str]]:
    """(name, starting role) of each worker of a local cluster: producers, then consumers,
    then colocated, numbered in that order. The name is the worker's id at the router and
    its process's name here (log file, restarts); it names no role, since the router may
    change the role (``pdserve plan apply``) and the id stays."""
    roles = ["producer"] * producers + ["consumer"] * consumers + ["colocated"] * colocated
    return [(f"worker-{k}", role) for k, role in enumerate(roles)]


def assign_devices(devices: tuple[str, ...], producers: int, consumers: int,
                   colocated: int) -> dict[str, str]:
    """Worker name -> device, cycling over producers, then consumers, then colocated."""
    if not devices:
        return {}
    names = worker_names(producers, consumers, colocated)
    return {name: devices[k % len(devices)] for k, (name, _) in enumerate(names)}
