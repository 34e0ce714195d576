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
    """(worker id, role, KV fingerprint) of every producer and consumer: one layout only,
    or KV pushed between them would be read as garbage."""
    pd = [(w, r, f) for w, r, f in workers if r in ("producer", "consumer")]
    if not pd:
        return Check("kv fingerprints", WARN, "no producer or consumer reports one")
    prints = {f for _, _, f in pd}
    if len(prints) > 1:
        groups = ", ".join(f"{f or '(none)'}: {' '.join(w for w, _, g in pd if g == f)}"
                           for f in sorted(prints))
        return Check("kv fingerprints", FAIL, f"{len(prints)} KV layouts: {groups}")
    return Check("kv fingerprints", PASS, f"{prints.pop()} on {len(pd)} worker(s)")


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


def cluster_checks(router: str, api_key: str = "", timeout: float = 5.0) -> list[Check]:
    """The cluster as the router sees it, and this node's reach to each worker."""
    import grpc
    from pdserve.v1 import router_pb2, router_pb2_grpc

    from deploy.cluster import ROLE_NAMES

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    try:
        with grpc.insecure_channel(router) as ch:
            status = router_pb2_grpc.RouterStub(ch).ClusterStatus(
                router_pb2.ClusterStatusRequest(), timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        return [Check("router", FAIL, f"{router}: {e.code().name} {e.details()}")]
    out = [Check("router", PASS, f"{router}, policy {status.policy}, "
                                 f"{len(status.workers)} worker(s)")]
    roles = {ROLE_NAMES.get(w.role, "?") for w in status.workers if w.healthy}
    if not ({"producer", "consumer"} <= roles or "colocated" in roles):
        out.append(Check("roles", FAIL, f"healthy roles {sorted(roles)}: cannot serve"))
    else:
        out.append(Check("roles", PASS, ", ".join(sorted(roles))))
    if "kv_fingerprint" in router_pb2.WorkerStatus.DESCRIPTOR.fields_by_name:
        out.append(check_fingerprints([(w.worker_id, ROLE_NAMES.get(w.role, "?"),
                                        getattr(w, "kv_fingerprint"))  # noqa: B009 - absent from older stubs
                                       for w in status.workers]))
    else:  # until the router reports them (router.proto WorkerStatus.kv_fingerprint)
        out.append(Check("kv fingerprints", WARN, "this router does not report them; it "
                                                  "refuses a mismatched worker at Register"))
    for w in status.workers:
        name = f"{ROLE_NAMES.get(w.role, '?')} {w.worker_id}"
        if not w.healthy:
            out.append(Check(name, FAIL, f"unhealthy: {w.unhealthy_reason}"))
        else:
            out.append(Check(name, PASS, f"heartbeat {w.last_heartbeat_age_s:.1f} s ago"))
        out.append(check_port(f"{name} gRPC port", w.address, timeout))
    return out


def render(checks: list[Check]) -> str:
    width = max([len(c.name) for c in checks] + [5])
    lines = [f"{'check':{width}s}  status  detail"]
    lines += [f"{c.name:{width}s}  {c.status.upper():6s}  {c.detail}" for c in checks]
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def env_api_key() -> str:
    return os.environ.get("PDSERVE_API_KEY", "")
