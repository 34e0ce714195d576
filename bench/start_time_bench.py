"""How long a worker and the router take to start (the cost of what their processes import).

For each code tree given (default: this checkout), trials alternating between trees:
  * router: spawn `python -m deploy.cli router` -> its gRPC health answers;
  * worker: spawn `python -m deploy.cli colocated` against a router -> the router lists it
    healthy; also when the worker's gRPC process spawned its engine process (the gRPC
    process's own import and config cost).

    python bench/start_time_bench.py --trials 8 [--trees OLD_TREE NEW_TREE]

OLD_TREE can be e.g. `git archive REV | tar -x -C DIR`; every tree runs with this Python.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "proto")]
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from pdserve.v1 import router_pb2, router_pb2_grpc  # noqa: E402

from deploy.ports import free_port  # noqa: E402


def spawn(tree: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree}/proto")
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def router_start_s(tree: str) -> float:
    port = free_port("127.0.0.1")
    t0 = time.monotonic()
    p = spawn(tree, "router", "--grpc-port", str(port))
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:  # NOT_SERVING until workers join is still an answer
                stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                return time.monotonic() - t0
            except grpc.RpcError:
                if p.poll() is not None:
                    raise SystemExit(f"router exited {p.returncode}") from None
                time.sleep(0.02)
    finally:
        ch.close()
        stop(p)


def engine_child(pid: int) -> bool:
    """Whether the worker has spawned its engine process (a multiprocessing spawn child)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        for c in kids:
            with open(f"/proc/{c}/cmdline", "rb") as g:
                if b"spawn_main" in g.read():
                    return True
    except OSError:
        pass
    return False


def worker_start_s(tree: str, stub: router_pb2_grpc.RouterStub, addr: str,
                   wid: str) -> tuple[float, float]:
    def healthy() -> bool:
        try:
            status = stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return any(w.worker_id == wid and w.healthy for w in status.workers)

    t0 = time.monotonic()
    p = spawn(tree, "colocated", "--router", addr, "--threads", "1", "--kv-cache-mib", "64",
              "--metrics-port", "-1", "--worker-id", wid)
    engine_at = float("nan")
    try:
        while not healthy():
            if engine_at != engine_at and engine_child(p.pid):
                engine_at = time.monotonic() - t0
            if p.poll() is not None:
                raise SystemExit(f"worker exited {p.returncode}")
            time.sleep(0.02)
        return engine_at, time.monotonic() - t0
    finally:
        stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--trees", nargs="+", default=[REPO])
    args = ap.parse_args()
    routers: dict[str, list[float]] = {t: [] for t in args.trees}
    workers: dict[str, list[tuple[float, float]]] = {t: [] for t in args.trees}
    for _ in range(args.trials):
        for t in args.trees:
            routers[t].append(router_start_s(t))
    port = free_port("127.0.0.1")
    addr = f"127.0.0.1:{port}"
    router = spawn(args.trees[-1], "router", "--grpc-port", str(port), "--heartbeat-timeout",
                   "2")
    ch = grpc.insecure_channel(addr)
    try:
        stub = router_pb2_grpc.RouterStub(ch)
        time.sleep(3)
        for i in range(args.trials):
            for j, t in enumerate(args.trees):
                workers[t].append(worker_start_s(t, stub, addr, f"w{i}-{j}"))
                time.sleep(1)
    finally:
        ch.close()
        stop(router)
    for t in args.trees:
        w = workers[t]
        print(f"{t}: router health {statistics.median(routers[t]):.2f} s, worker engine "
              f"spawned {statistics.median(x[0] for x in w):.2f} s, worker healthy "
              f"{statistics.median(x[1] for x in w):.2f} s (medians of {args.trials}; load "
              f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
