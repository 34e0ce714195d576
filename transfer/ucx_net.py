"""Which network devices UCX may use, from the address the operator gave the transfer.

UCX opens a listening TCP socket on every network device it is allowed (its TCP
transport's connection setup), whatever address pdserve's own sockets bind: with the
default ``--host 127.0.0.1`` the engine processes also listened on the machine's network
address. So when the transfer's host is one address, UCX (and NIXL's UCX backend, and the
plane probe's child, which inherit the environment) gets ``UCX_NET_DEVICES`` = the
interface holding that address, plus the host's InfiniBand ports (RDMA verbs listen on no
IP socket, and between hosts they are the fast path). A wildcard host (``0.0.0.0``,
``::``) leaves UCX its default, all devices; so does a ``UCX_NET_DEVICES`` the operator
set. Shared memory, CMA and cuda_ipc are not network devices: they are unaffected.

This module imports no UCX: it only chooses the setting, before any UCX context exists.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

ENV = "UCX_NET_DEVICES"
# Set next to ENV when pdserve chose it: a child process (a worker started from a process
# that made a transfer, a test's cluster) inherits both and chooses again for its own host,
# while a value the operator set (without the mark) is always kept.
MARK = "PDSERVE_UCX_NET_DEVICES_AUTO"
WILDCARDS = ("", "0.0.0.0", "::", "*")
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
IFF_LOOPBACK = 0x8
IB_ROOT = "/sys/class/infiniband"


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of() -> dict[str, str]:
    """Address -> interface, from /proc/net/if_inet6 (every IPv6 address of the host)."""
    out = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, *_, name = line.split()
                out[str(ipaddress.ip_address(bytes.fromhex(hexaddr)))] = name
    except OSError:
        pass
    return out


def _loopback_names() -> list[str]:
    names = []
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & IFF_LOOPBACK:
                    names.append(name)
        except (OSError, ValueError):
            pass
    return names or ["lo"]


def interface_of(ip: str) -> str | None:
    """The network interface holding ``ip`` (an address literal), or None."""
    addr = ipaddress.ip_address(ip)
    if addr.is_loopback:  # 127.0.0.0/8 all lives on the loopback interface
        return _loopback_names()[0]
    if addr.version == 6:
        return _ipv6_of().get(str(addr))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(addr):
            return name
    return None


def _ib_ports(root: str = IB_ROOT) -> list[str]:
    try:
        return [f"{dev}:{port}" for dev in sorted(os.listdir(root))
                for port in sorted(os.listdir(os.path.join(root, dev, "ports")))]
    except OSError:
        return []


def net_devices(host: str) -> str | None:
    """The ``UCX_NET_DEVICES`` value for a transfer bound to ``host``; None: UCX's default
    (a wildcard, or a host whose interface cannot be found)."""
    if host in WILDCARDS:
        return None
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    ips = [str(i[4][0]) for i in infos]
    if any(ip in WILDCARDS for ip in ips):
        return None
    names = []
    for ip in ips:
        name = interface_of(ip.split("%")[0])
        if name is not None and name not in names:
            names.append(name)
    if not names:
        return None
    if not all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
        names += _ib_ports()  # one host's peers need no RDMA; other hosts' may
    return ",".join(names)


def restrict_to_host(host: str) -> None:
    """Sets ``UCX_NET_DEVICES`` for ``host`` in this process's environment (before any UCX
    context is made; children inherit it), unless the operator set it."""
    if ENV in os.environ and os.environ.get(MARK) != os.environ[ENV]:
        return  # the operator's choice
    devices = net_devices(host)
    if devices is None:
        os.environ.pop(ENV, None)
        os.environ.pop(MARK, None)
        return
    if os.environ.get(ENV) != devices:
        log.info("UCX network devices limited to %s (the transfer's host %s)", devices, host)
    os.environ[ENV] = os.environ[MARK] = devices
