"""Preflight checks for a node and for a running cluster (`pdserve doctor`): each check is a
function returning a Check; the command prints them as a table and fails on any FAIL."""

from __future__ import annotations

import importlib.metadata
import os
import socket
from dataclasses import dataclass

PASS, WARN, FAIL = "pass", "warn", "fail"

REQUIRED = ("torch", "numpy", "grpcio", "protobuf", "pyzmq", "msgpack", "tokenizers",
            "safetensors", "gguf", "aiohttp", "prometheus_client", "pyyaml")
OPTIONAL = {"ucxx-cu12": "the ucx KV transfer backend", "nixl-cu12": "the nixl RDMA backend",
            "triton": "GPU kernels"}
THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, WARN or FAIL
    detail: str


def check_packages(required: tuple[str, ...] = REQUIRED,
                   optional: dict[str, str] | None = None) -> list[Check]:
    out = []
    missing, found = [], []
    for pkg in required:
        try:
            found.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(pkg)
    if missing:
        out.append(Check("packages", FAIL, f"missing: {', '.join(missing)}"))
    else:
        out.append(Check("packages", PASS, ", ".join(found)))
    for pkg, why in (OPTIONAL if optional is None else optional).items():
        try:
            out.append(Check(f"package {pkg}", PASS, importlib.metadata.version(pkg)))
        except importlib.metadata.PackageNotFoundError:
            out.append(Check(f"package {pkg}", WARN, f"not installed ({why} unavailable)"))
    return out


def check_cuda() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("cuda", WARN, "no CUDA device: workers run on CPU")]
    n = torch.cuda.device_count()
    out = [Check("cuda", PASS, f"{n} device(s), {torch.cuda.get_device_name(0)}, "
                               f"CUDA {torch.version.cuda}")]
    if n > 1:
        no_peer = [f"{a}->{b}" for a in range(n) for b in range(n)
                   if a != b and not torch.cuda.can_device_access_peer(a, b)]
        out.append(Check("gpu peer access", WARN if no_peer else PASS,
                         f"no peer access {', '.join(no_peer)}" if no_peer
                         else "every pair"))
    return out


RDMA_PREFIXES = ("rc_", "dc_", "ud_")  # verbs / mlx5 transports: InfiniBand or RoCE


def transport_checks(names: set[str]) -> list[Check]:
    rdma = sorted(t for t in names if t.startswith(RDMA_PREFIXES))
    return [Check("ucx transports", PASS if names else FAIL, ", ".join(sorted(names)) or "none"),
            Check("rdma", PASS if rdma else WARN,
                  ", ".join(rdma) if rdma else "no RDMA transport: KV moves over TCP/shm")]


def check_ucx() -> list[Check]:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx
    except ImportError as e:
        return [Check("ucx transports", WARN, f"ucxx not importable ({e})")]
    try:
        names = set(ucxx.get_active_transports())
    except Exception as e:  # noqa: BLE001 - any UCX failure is this check's finding
        return [Check("ucx transports", FAIL, f"UCX did not start: {e}")]
    return transport_checks(names)


def check_thp(path: str = THP_PATH) -> Check:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return Check("transparent huge pages", WARN, f"{path} unreadable")
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()
    if mode == "never":
        return Check("transparent huge pages", WARN,
                     "never: CPU KV pools use 4 KiB pages (slower UCX transfers)")
    return Check("transparent huge pages", PASS, mode)


def check_port(name: str, address: str, timeout: float = 3.0) -> Check:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return Check(name, PASS, f"{address} reachable")
    except (OSError, ValueError) as e:
        return Check(name, FAIL, f"{address} unreachable ({e})")


def check_fingerprints(workers: list[tuple[str, str, str]]) -> Check:
    """(worker id, role, KV fingerprint) of every worker: one layout only. Producers and
    consumers with two layouts would read each other's KV as garbage, and since the router
    can change any worker's role (``pdserve plan apply``), colocated workers count too."""
    if not workers:
        return Check("kv fingerprints", WARN, "no worker reports one")
    prints = {f for _, _, f in workers}
    if len(prints) > 1:
        groups = ", ".join(f"{f or '(none)'}: {' '.join(w for w, _, g in workers if g == f)}"
                           for f in sorted(prints))
        return Check("kv fingerprints", FAIL, f"{len(prints)} KV layouts: {groups}")
    return Check("kv fingerprints", PASS, f"{prints.pop()} on {len(workers)} worker(s)")


def check_versions(workers: list[tuple[str, str]]) -> Check:
    """(worker id, pdserve version) of every worker: one version only (a rolling upgrade
    in progress shows here until it is done)."""
    if not workers:
        return Check("versions", WARN, "no worker reports one")
    versions = {v for _, v in workers}
    if len(versions) > 1:
        groups = ", ".join(f"{v or '(not reported)'}: {' '.join(w for w, g in workers if g == v)}"
                           for v in sorted(versions))
        return Check("versions", FAIL, f"{len(versions)} versions: {groups}")
    return Check("versions", PASS, f"{versions.pop() or '(not reported)'} on {len(workers)} "
                                   f"worker(s)")


def check_kv_port(name: str, kv_address: str, timeout: float = 3.0) -> Check:
    """A consumer's KV address (``tcp://host:port``, what producers dial) accepts TCP."""
    scheme, sep, rest = kv_address.partition("://")
    if sep and scheme != "tcp":
        return Check(name, WARN, f"{kv_address}: not a TCP address, not checked")
    return check_port(name, rest if sep else kv_address, timeout)


def check_outputs(name: str, outputs_address: str, outputs_transport: str,
                  timeout: float = 3.0, outputs_unix: str = "") -> list[Check]:
    """A worker's plain-TCP Outputs port (``--outputs-port``) accepts TCP here, and the router
    reads its plain stream: a router that could not reach it reads the Outputs RPC instead,
    which works but costs more CPU per token on both ends. A router on the worker's host
    reads its Unix socket (``outputs_unix``), and says so; the port is checked all the same,
    since a router elsewhere (a frontend on another host, or after a move) reads that."""
    if not outputs_address:
        return []
    out = [check_port(f"{name} Outputs port", outputs_address, timeout)]
    if outputs_transport == "unix":
        out.append(Check(f"{name} Outputs stream", PASS,
                         f"the router reads its Unix socket {outputs_unix} (same host)"))
    elif outputs_transport == "grpc":
        out.append(Check(f"{name} Outputs stream", WARN,
                         f"the router could not reach {outputs_address} and reads the Outputs "
                         f"RPC instead (more CPU per token): open the port to the router"))
    return out


def check_clock(remote_date: str, now: float, warn_s: float = 1.5,
                fail_s: float = 30.0) -> Check:
    """The router's HTTP Date header against this node's clock (1 s resolution)."""
    from email.utils import parsedate_to_datetime

    skew = parsedate_to_datetime(remote_date).timestamp() - now
    status = FAIL if abs(skew) > fail_s else WARN if abs(skew) > warn_s else PASS
    return Check("clock skew", status, f"{skew:+.1f} s against the router")


def clock_checks(http: str, timeout: float = 5.0) -> list[Check]:
    import time
    import urllib.request

    try:
        t0 = time.time()
        with urllib.request.urlopen(f"{http.rstrip('/')}/health", timeout=timeout) as r:
            date = r.headers.get("Date", "")
        now = (t0 + time.time()) / 2
    except OSError as e:
        code = getattr(e, "code", None)
        if code is None:
            return [Check("router HTTP", FAIL, f"{http}: {e}")]
        date = e.headers.get("Date", "")  # type: ignore[attr-defined]
        now = time.time()
    if not date:
        return [Check("clock skew", WARN, f"{http} sent no Date header")]
    return [check_clock(date, now)]


def node_checks() -> list[Check]:
    return [*check_packages(), *check_cuda(), *check_ucx(), check_thp()]


def cluster_checks(router: str, api_key: str = "", timeout: float = 5.0,
                   router_ca: str = "") -> list[Check]:
    """The cluster as the router sees it, and this node's reach to each worker."""
    import grpc
    from pdserve.v1 import router_pb2, router_pb2_grpc

    from deploy.cluster import ROLE_NAMES
    from deploy.router_client import auth_metadata, channel, error_line

    try:
        with channel(router, router_ca) as ch:
            status = router_pb2_grpc.RouterStub(ch).ClusterStatus(
                router_pb2.ClusterStatusRequest(), timeout=timeout,
                metadata=auth_metadata(api_key))
    except grpc.RpcError as e:
        return [Check("router", FAIL, error_line(router, e))]
    out = [Check("router", PASS, f"{router}, policy {status.policy}, "
                                 f"{len(status.workers)} worker(s)")]
    roles = {ROLE_NAMES.get(w.role, "?") for w in status.workers if w.healthy and not w.draining}
    if not ({"producer", "consumer"} <= roles or "colocated" in roles):
        out.append(Check("roles", FAIL, f"healthy roles {sorted(roles)}: cannot serve"))
    else:
        out.append(Check("roles", PASS, ", ".join(sorted(roles))))
    out.append(check_fingerprints([(w.worker_id, ROLE_NAMES.get(w.role, "?"), w.kv_fingerprint)
                                   for w in status.workers]))
    out.append(check_versions([(w.worker_id, w.version) for w in status.workers]))
    for w in status.workers:
        name = f"{ROLE_NAMES.get(w.role, '?')} {w.worker_id}"
        if not w.healthy:
            out.append(Check(name, FAIL, f"unhealthy: {w.unhealthy_reason}"))
        elif w.draining:
            target = f" (becoming {ROLE_NAMES[w.target_role]})" if w.target_role else ""
            out.append(Check(name, WARN, f"draining{target}: takes no new requests"))
        else:
            out.append(Check(name, PASS, f"heartbeat {w.last_heartbeat_age_s:.1f} s ago"))
        out.append(check_port(f"{name} gRPC port", w.address, timeout))
        out.extend(check_outputs(name, w.outputs_address, w.outputs_transport, timeout,
                                 w.outputs_unix))
        ranks = [a for a in w.kv_address.split(",") if a]  # a TP consumer: one per rank
        for r, addr in enumerate(ranks):
            rank = f" (rank {r})" if len(ranks) > 1 else ""
            out.append(check_kv_port(f"{name} KV port{rank}", addr, timeout))
    return out


def render(checks: list[Check]) -> str:
    width = max([len(c.name) for c in checks] + [5])
    lines = [f"{'check':{width}s}  status  detail"]
    lines += [f"{c.name:{width}s}  {c.status.upper():6s}  {c.detail}" for c in checks]
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0

