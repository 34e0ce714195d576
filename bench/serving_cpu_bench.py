"""Serving-plane CPU per streamed token: what the router and each worker's processes spend.

Starts a local cluster (router + workers, each its own process group, as `pdserve launch`
does), drives it with N concurrent streaming clients spread over several client processes
(the router's gRPC ``Generate``, or OpenAI HTTP SSE), and reads every cluster process's CPU
time (utime + stime from /proc/<pid>/stat) before and after the measured window. Reports
µs of CPU per streamed token for the router, each worker's service (gRPC) process and its
engine process, the clients' own CPU (so a client bottleneck is visible), tokens/s,
TTFT/TPOT/ITL percentiles and failures. "router" sums every process of the router's process
group (front doors it spawns, e.g. ``--router-arg=--frontends=4``); each part lists its
processes with their own CPU.

Engines: ``--model tiny-dummy`` (a tiny Llama config with ``--load-format dummy``: real
forwards, negligible weights) or ``--simulate-step-ms MS`` (simulated engines: no model,
MS per step, any batch), the latter to load the serving plane at GPU token rates.

    python bench/serving_cpu_bench.py --model tiny-dummy --concurrency 64 \
        --input-len 64 --output-len 256 --out /tmp/cpu.json
    python bench/serving_cpu_bench.py --simulate-step-ms 20 --concurrency 1000 \
        --input-len 64 --output-len 256 --client-procs 8 --out /tmp/sim.json

It measures whatever code is checked out: the cluster runs ``python -m deploy.cli`` from
this repository.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the repository's packages come first
    sys.path.insert(0, ROOT)
    sys.path.insert(1, os.path.join(ROOT, "proto"))

from deploy.benchmark.backend import SamplingChoice  # noqa: E402
from deploy.benchmark.proc_cpu import cpu_between, snapshot  # noqa: E402
from deploy.benchmark.record import RequestRecord  # noqa: E402
from deploy.benchmark.spread_backend import SpreadBackend  # noqa: E402
from deploy.benchmark.workload import LengthRange, RequestSpec, random_workload  # noqa: E402

TINY_DUMMY = "tiny-dummy"


# -- clients ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClientJob:
    backend: str  # "grpc" | "http" ("grpc-stream" runs as "grpc" on the stream door's port)
    address: str  # router gRPC host:port
    base_url: str  # HTTP base URL (backend "http")
    specs: list[tuple[int, RequestSpec]]  # (workload index, request) this client sends
    concurrency: int  # streams this client keeps open
    warmup: int  # unmeasured requests before the start signal, per connection
    sampling: SamplingChoice
    connections: int = 1  # client connections (channels) its streams spread over
    client: str = "grpcio"  # gRPC client: grpcio's asyncio one, or hand-framed HTTP/2 ("h2")


def _backend(job: ClientJob) -> Any:
    if job.backend == "grpc" and job.client == "h2":
        from deploy.benchmark.h2_grpc_backend import H2GrpcBackend

        return H2GrpcBackend(job.address)
    if job.backend == "grpc":
        from deploy.benchmark.grpc_backend import GrpcBackend

        return GrpcBackend(job.address)
    from deploy.benchmark.openai_backend import OpenAIBackend

    return OpenAIBackend(job.base_url)


async def _client(job: ClientJob, ready: Any, go: Any) -> dict[str, Any]:
    # Several connections per client process: a router's frontends share their port by
    # SO_REUSEPORT, which balances connections, not streams, so a handful of multiplexed
    # connections would load the frontends unevenly (real traffic comes on many).
    # (GrpcBackend opts out of gRPC's shared subchannel pool: each is its own connection)
    spread = SpreadBackend([_backend(job) for _ in range(max(1, job.connections))])
    await spread.open()
    try:
        warm = [job.specs[i % len(job.specs)][1] for i in range(job.warmup)]
        for b in spread.backends:
            for spec in warm:  # connections up, first-request costs paid
                await b.send(spec, RequestRecord(-1, spec.prompt_len, spec.output_len),
                             job.sampling)
        ready.put(os.getpid())
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        t_cpu = os.times()
        records = [RequestRecord(i, s.prompt_len, s.output_len) for i, s in job.specs]
        queue = list(range(len(job.specs)))[::-1]

        async def stream(backend: Any) -> None:
            while queue:
                k = queue.pop()
                try:
                    await backend.send(job.specs[k][1], records[k], job.sampling)
                except Exception as e:  # a client bug is a visible failure, not a hang
                    records[k].error, records[k].success = f"client: {e!r}", False
                    records[k].end = time.perf_counter()

        await asyncio.gather(*(stream(spread) for _ in range(job.concurrency)))
        t_end = os.times()
        cpu = (t_end.user - t_cpu.user) + (t_end.system - t_cpu.system)
        return {"records": records, "cpu_s": cpu, "pid": os.getpid()}
    finally:
        await spread.close()


def client_main(job: ClientJob, ready: Any, go: Any, results: Any) -> None:
    try:
        results.put(asyncio.run(_client(job, ready, go)))
    except BaseException as e:
        ready.put(-1)
        results.put({"error": f"{type(e).__name__}: {e}", "pid": os.getpid()})


# -- the run ------------------------------------------------------------------------------------

def _cluster_spec(args: argparse.Namespace, model: str | None, stream_port: int = -1) -> Any:
    """stream_port: the router's hand-framed Generate door (--grpc-stream-port); -1: off."""
    from deploy.cluster import ClusterSpec

    worker = list(args.worker_arg)
    if args.simulate_step_ms is not None:
        worker += ["--simulate-step-ms", str(args.simulate_step_ms),
                   "--simulate-prefill-us-per-token", str(args.simulate_prefill_us_per_token)]
        if not any(a.startswith("--device") for a in worker):
            worker += ["--device", "cpu"]  # on a GPU host too: no CUDA context per worker
    elif args.model == TINY_DUMMY:
        worker += ["--load-format", "dummy"]
    if not any(a.startswith("--max-num-seqs") for a in worker):
        worker += ["--max-num-seqs", str(max(64, args.concurrency))]
    router = ["--max-running-requests", str(max(512, args.concurrency)),
              "--max-queued-requests", str(max(1024, args.concurrency)), *args.router_arg]
    if stream_port >= 0:
        router += ["--grpc-stream-port", str(stream_port)]
    # the cluster runs this tree's code (or --code-tree's: an older commit measured by the
    # same clients and meter), whatever an installed pdserve would give
    code = args.code_tree or ROOT
    path = os.pathsep.join([code, os.path.join(code, "proto"),
                            *filter(None, [os.environ.get("PYTHONPATH")])])
    return ClusterSpec(producers=args.producers, consumers=args.consumers,
                       colocated=args.colocated, model=model, worker_args=tuple(worker),
                       env={"PYTHONPATH": path},
                       router_args=tuple(router),
                       http_port=0 if args.backend == "http" else -1,
                       transfer_backend=args.transfer_backend)


def _collect(results: Any, clients: list[Any]) -> list[dict[str, Any]]:
    """Every client's result; a client that died without one fails the run at once."""
    import queue

    outs: list[dict[str, Any]] = []
    while len(outs) < len(clients):
        try:
            outs.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in clients if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"client process {dead[0].pid} exited with "
                                   f"{dead[0].exitcode} before reporting") from None
    return outs


def _split(items: list[Any], n: int) -> list[list[Any]]:
    return [items[i::n] for i in range(n)]


def _pcts(values: list[float]) -> dict[str, float | None]:
    from deploy.benchmark.metrics import distribution

    d = distribution(values, (50.0, 90.0, 99.0))
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.benchmark.dummy_model import write_dummy_model
    from deploy.cluster import LocalCluster
    from deploy.ports import free_port

    load_start = os.getloadavg()  # a shared machine's other work skews every number
    tmp = tempfile.mkdtemp(prefix="pdserve-cpu-bench-")
    model = args.model
    if model == TINY_DUMMY:
        model = write_dummy_model(os.path.join(tmp, "tiny-dummy"), "tiny")
    specs = random_workload(args.num_prompts, LengthRange.parse("--input-len", args.input_len),
                            LengthRange.parse("--output-len", str(args.output_len)),
                            LengthRange.parse("--token-range", args.token_range), args.seed)
    sampling = SamplingChoice(ignore_eos=True, timeout_s=args.request_timeout)
    procs_n = max(1, min(args.client_procs or max(2, math.ceil(args.concurrency / 250)),
                         args.concurrency))
    # the same grpcio clients, on the router's hand-framed door (router/grpc_stream/)
    stream_port = free_port("127.0.0.1") if args.backend == "grpc-stream" else -1
    cluster = LocalCluster(_cluster_spec(args, model, stream_port), log_dir=args.log_dir or
                           os.path.join(tmp, "logs"))
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    clients: list[Any] = []
    t_start = time.monotonic()
    cluster.start()
    try:
        started_s = time.monotonic() - t_start
        base_url = f"http://{cluster.spec.host}:{cluster.http_port}"
        indexed = list(enumerate(specs))
        conc = _split(list(range(args.concurrency)), procs_n)
        for share, streams in zip(_split(indexed, procs_n), conc, strict=True):
            address = (f"{cluster.spec.host}:{stream_port}" if stream_port >= 0
                       else cluster.router_address)
            job = ClientJob("http" if args.backend == "http" else "grpc", address, base_url,
                            share, max(1, len(streams)), args.warmup, sampling,
                            args.connections_per_client, args.client)
            p = ctx.Process(target=client_main, args=(job, ready, go, results), daemon=True)
            p.start()
            clients.append(p)
        for _ in clients:
            if ready.get(timeout=args.request_timeout) == -1:
                raise RuntimeError(f"a client failed to start: {results.get(timeout=5)}")
        groups = {name: p.pid for name, p in cluster.procs.items()}
        idle: dict[str, Any] = {}
        if args.idle_s > 0:  # the fixed per-second costs: cluster up, clients connected
            i0 = snapshot(groups)
            t_idle = time.perf_counter()
            time.sleep(args.idle_s)
            idle_wall = time.perf_counter() - t_idle
            idle = {part: v["cpu_s"] / idle_wall
                    for part, v in cpu_between(i0, snapshot(groups)).items()}
        before = snapshot(groups)
        t0 = time.perf_counter()
        go.set()
        outs = _collect(results, clients)
        after = snapshot(groups)
        wall = time.perf_counter() - t0
        used = cpu_between(before, after)  # reads command lines: before the cluster stops
        for p in clients:
            p.join(10)
    finally:
        for p in clients:
            if p.is_alive():
                p.kill()
        cluster.stop()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"client process failed: {errors[0]}")
    records: list[RequestRecord] = [r for o in outs for r in o["records"]]
    ok = [r for r in records if r.success]
    streamed = sum(n for r in records for _, n in r.arrivals)
    counted = sum(r.output_tokens for r in ok)
    expected = sum(s.output_len for s in specs)
    duration = (max(r.end for r in records) - min(r.start for r in records)) if records \
        else wall
    # gRPC messages say how many tokens they carry; an SSE chunk does not (its count is one
    # per chunk), so over HTTP the usage counts of completed requests are the basis
    basis = counted if args.backend == "http" else streamed
    per_token = max(basis, 1)
    cpu: dict[str, Any] = {}
    for part, v in sorted(used.items()):
        cpu[part] = {"cpu_s": round(v["cpu_s"], 3),
                     "us_per_token": round(v["cpu_s"] / per_token * 1e6, 2),
                     "cores": round(v["cpu_s"] / wall, 3), "procs": v["procs"]}
        if part in idle:
            # what the process spends per second with nothing to serve, and that share of
            # its per-token figure at this token rate (the rest grows with the load)
            cpu[part]["idle_cores"] = round(idle[part], 4)
            cpu[part]["idle_us_per_token"] = round(
                idle[part] * wall / per_token * 1e6, 2)
    routers = [v["cpu_s"] for k, v in used.items() if k.startswith("router")]
    if len(routers) > 1:  # front doors started as processes of their own
        cpu["routers_total"] = {"cpu_s": round(sum(routers), 3),
                                "us_per_token": round(sum(routers) / per_token * 1e6, 2),
                                "cores": round(sum(routers) / wall, 3)}
    client_cpu = sum(o["cpu_s"] for o in outs)
    cpu["clients"] = {"cpu_s": round(client_cpu, 3),
                      "us_per_token": round(client_cpu / per_token * 1e6, 2),
                      "cores": round(client_cpu / wall, 3), "processes": len(outs),
                      "per_process_cores": [round(o["cpu_s"] / wall, 3) for o in outs]}
    msgs = sum(len(r.arrivals) for r in ok)
    return {
        "tool": "bench/serving_cpu_bench.py", "command": sys.argv,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "cpu": _cpu_model(), "host": platform.node(),
                    "python": platform.python_version(), "load_avg_start": load_start,
                    "load_avg_end": os.getloadavg()},
        "tree": _tree(args.code_tree),
        "config": {"model": args.model, "simulate_step_ms": args.simulate_step_ms,
                   "producers": args.producers, "consumers": args.consumers,
                   "colocated": args.colocated, "concurrency": args.concurrency,
                   "client_procs": len(outs), "num_prompts": len(specs),
                   "connections_per_client": args.connections_per_client,
                   "input_len": args.input_len, "output_len": args.output_len,
                   "backend": args.backend, "client": args.client,
                   "worker_args": list(cluster.spec.worker_args),
                   "router_args": list(cluster.spec.router_args),
                   "transfer_backend": args.transfer_backend},
        "roles": dict(cluster.started_as),  # worker name -> its role (the cpu parts' names)
        "cluster_start_s": round(started_s, 2),
        "duration_s": round(duration, 3), "window_s": round(wall, 3),
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "tokens_expected": expected, "tokens_streamed": streamed, "tokens_counted": counted,
        "tokens_basis": "tokens_counted" if args.backend == "http" else "tokens_streamed",
        "messages": msgs, "tokens_per_message": round(streamed / msgs, 3) if msgs else None,
        "tokens_per_s": round(basis / duration, 1) if duration > 0 else None,
        "ttft_ms": _pcts([r.ttft * 1e3 for r in ok if r.ttft is not None]),
        "tpot_ms": _pcts([r.tpot * 1e3 for r in ok if r.tpot is not None]),
        "itl_ms": _pcts([g * 1e3 for r in ok for g in r.itl]),
        "e2el_ms": _pcts([r.e2el * 1e3 for r in ok]),
        "cpu": cpu,
    }


def _tree(code: str | None = None) -> dict[str, Any]:
    """The commit the cluster ran, and whether its tree had uncommitted changes."""
    import subprocess

    def git(*a: str) -> str:
        r = subprocess.run(["git", "-C", code or ROOT, *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def summary_line(doc: dict[str, Any]) -> str:
    c = doc["config"]
    kind = f"sim {c['simulate_step_ms']} ms" if c["simulate_step_ms"] is not None \
        else c["model"] or "default model"
    shape = (f"{c['producers']}P{c['consumers']}D" if c["producers"]
             else f"{c['colocated']} colocated")
    cpu = doc["cpu"]
    parts = [f"{k} {v['us_per_token']:.1f}" for k, v in cpu.items() if v["cpu_s"] > 0]
    return (f"{shape} {kind} c={c['concurrency']} in={c['input_len']} out={c['output_len']}: "
            f"{doc['tokens_per_s']} tok/s, {doc['completed']}/{doc['requests']} ok, "
            f"TTFT p50 {doc['ttft_ms']['p50']} ms, TPOT p50 {doc['tpot_ms']['p50']} ms, "
            f"ITL p99 {doc['itl_ms']['p99']} ms; CPU µs/token: " + ", ".join(parts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    e = p.add_argument_group("engines")
    e.add_argument("--model", default=TINY_DUMMY,
                   help=f"'{TINY_DUMMY}' (tiny Llama config, dummy weights), a model "
                        "directory, or 'smollm2'")
    e.add_argument("--simulate-step-ms", type=float, default=None,
                   help="simulated engines: no model, this many ms per step")
    e.add_argument("--simulate-prefill-us-per-token", type=float, default=0.0)
    e.add_argument("--producers", type=int, default=1)
    e.add_argument("--consumers", type=int, default=1)
    e.add_argument("--colocated", type=int, default=0)
    e.add_argument("--transfer-backend", default="ucx")
    e.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every worker, e.g. --worker-arg=--max-num-seqs=256")
    e.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the router, e.g. --router-arg=--frontends=4")
    e.add_argument("--code-tree", default=None,
                   help="run the cluster from this checkout (e.g. a worktree of an older "
                        "commit) instead of the bench's own tree")
    w = p.add_argument_group("load")
    w.add_argument("--backend", default="grpc", choices=("grpc", "grpc-stream", "http"),
                   help="grpc: the router's Generate stream; grpc-stream: the same on its "
                        "hand-framed door (--grpc-stream-port); http: /v1/completions SSE")
    w.add_argument("--client", default="grpcio", choices=("grpcio", "h2"),
                   help="the gRPC backends' client: grpcio's asyncio client, or a hand-framed "
                        "HTTP/2 one (deploy/benchmark/h2_connection.py) that takes a fraction "
                        "of its CPU per token, leaving the host's cores to what is measured")
    w.add_argument("--concurrency", type=int, default=64, help="streams open at once")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="measured requests (default: 2x --concurrency)")
    w.add_argument("--input-len", default="64")
    w.add_argument("--output-len", type=int, default=256, help="exact: EOS is ignored")
    w.add_argument("--token-range", default="1000:30000")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--client-procs", type=int, default=0,
                   help="client processes sharing the streams (default: max(2, c/250))")
    w.add_argument("--warmup", type=int, default=1,
                   help="unmeasured requests per client connection")
    w.add_argument("--connections-per-client", type=int, default=1,
                   help="connections each client process spreads its streams over (several "
                        "balance the frontends of --router-arg=--frontends=N)")
    w.add_argument("--request-timeout", type=float, default=600.0)
    w.add_argument("--idle-s", type=float, default=0.0,
                   help="first measure this many seconds of the cluster idle (clients "
                        "connected, no requests): each part's idle_cores, and "
                        "idle_us_per_token, its share of the per-token figure")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="write the result JSON here")
    o.add_argument("--log-dir", default=None, help="cluster process logs (default: a tmp dir)")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.output_len < 1:
        p.error("--concurrency and --output-len must be >= 1")
    if args.num_prompts is None:
        args.num_prompts = 2 * args.concurrency
    if args.model == "smollm2":
        args.model = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(summary_line(doc), flush=True)
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
