"""Decode speed of a P/D consumer against a colocated worker, one request at a time, on a
model small enough that each step is host time (on CPU: ~1 ms of Python).

Starts a 1P1D cluster and a 1-colocated cluster one after the other, each worker with the
same engine flags and torch threads, and runs the same sequential requests on each. For
the decode worker it reports the client's TPOT, the worker's step counters (its /metrics:
mean step ms, mean host time between steps) and the CPU seconds each thread of its engine
process used per decoded token (which threads run while it decodes), and for the engine
loop's thread the time it waited for a core (a busy host, not the worker) and how often it
slept (GIL waits while decoding; idle waits between requests count too). ``--rounds`` repeats
the pair, alternating which goes first, so a machine shared with other work shows as
spread instead of as a difference.

    .venv/bin/python bench/consumer_step_bench.py --output-len 256 --requests 6 --rounds 2
    # 2 GPUs, Llama-3-8B shape:
    python bench/consumer_step_bench.py --preset llama3-8b --dtype bfloat16 \
        --devices cuda:0,cuda:1 --kv-cache-mib 16384 --threads 8 --input-len 512 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

import grpc
import psutil
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deploy.benchmark import dummy_model  # noqa: E402
from deploy.cluster import ClusterSpec, LocalCluster  # noqa: E402

COUNTERS = ("engine_steps", "engine_step_rows", "engine_step_seconds",
            "engine_step_gap_seconds", "engine_step_gaps")


def write_model(path: str, hidden: int, layers: int, vocab: int, preset: str) -> str:
    if preset:  # e.g. llama3-8b for a GPU run
        return dummy_model.write_dummy_model(path, preset)
    dummy_model.PRESETS["bench"] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 2 * hidden, "vocab_size": vocab,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2}
    return dummy_model.write_dummy_model(path, "bench")


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for key in COUNTERS:
        m = re.search(rf"^pdserve_worker_{key}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def engine_process(worker_pid: int) -> psutil.Process:
    """The worker's spawned engine process (not multiprocessing's resource tracker)."""
    kids = [p for p in psutil.Process(worker_pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())]
    if len(kids) != 1:
        raise RuntimeError(f"expected one engine process under {worker_pid}, got {kids}")
    return kids[0]


def thread_cpu(proc: psutil.Process) -> dict[int, tuple[str, float]]:
    """tid -> (OS thread name, CPU seconds so far); the engine loop's thread is "main"."""
    out = {}
    for t in proc.threads():
        try:
            with open(f"/proc/{proc.pid}/task/{t.id}/comm") as f:
                name = "main" if t.id == proc.pid else f.read().strip()
        except OSError:
            continue
        out[t.id] = (name, t.user_time + t.system_time)
    return out


def main_thread_sched(proc: psutil.Process) -> tuple[float, float, int]:
    """The engine loop thread's (CPU s, s runnable but waiting for a core, voluntary context
    switches): a step's wall time beyond its CPU time is either the run queue (a busy
    host) or sleeping (the GIL, a socket); only the sleeps are voluntary switches."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/schedstat") as f:
        cpu_ns, wait_ns, _ = (int(x) for x in f.read().split())
    with open(f"/proc/{proc.pid}/task/{proc.pid}/status") as f:
        vol = next(int(line.split()[1]) for line in f
                   if line.startswith("voluntary_ctxt_switches:"))
    return cpu_ns / 1e9, wait_ns / 1e9, vol


def generate(stub: Any, prompt: list[int], n: int) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, tokens) of one streamed request, timed at the client."""
    req = router_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        prompt_token_ids=router_pb2.TokenIds(ids=prompt))
    t0 = time.perf_counter()
    first = last = 0.0
    got = 0
    for msg in stub.Generate(req, timeout=600):
        now = time.perf_counter()
        if got == 0:
            first = now
        got += len(msg.token_ids)
        last = now
        if msg.error:
            raise RuntimeError(msg.error)
    return first - t0, (last - first) / max(1, got - 1), got


def run_kind(kind: str, args: argparse.Namespace, model: str, log_dir: str) -> dict[str, Any]:
    pd = kind == "pd"
    devices: tuple[str, ...] = ()
    if args.devices:  # producer, consumer; the colocated worker gets the consumer's device
        devs = args.devices.split(",")
        devices = tuple(devs) if pd else (devs[-1],)
    spec = ClusterSpec(producers=int(pd), consumers=int(pd), colocated=int(not pd),
                       model=model, threads=args.threads, transfer_backend=args.transfer_backend,
                       devices=devices,
                       worker_args=("--load-format", "dummy", "--dtype", args.dtype,
                                    "--kv-cache-mib", str(args.kv_cache_mib), *args.worker_arg))
    cluster = LocalCluster(spec, log_dir=os.path.join(log_dir, kind))
    cluster.start()
    try:
        name = cluster.names("consumer" if pd else "colocated")[0]
        eng = engine_process(cluster.procs[name].pid)
        ch = grpc.insecure_channel(cluster.router_address)
        stub = router_pb2_grpc.RouterStub(ch)
        prompt = [3 + (7 * i) % 200 for i in range(args.input_len)]
        for _ in range(2):  # warm-up: first steps, UCX handshake
            generate(stub, prompt, 16)
        time.sleep(0.5)  # a load report after the warm-up (every 0.25 s)
        m0, cpu0, w0 = metrics(cluster.metrics_ports[name]), thread_cpu(eng), time.perf_counter()
        s0 = main_thread_sched(eng)
        tpots, ttfts, tokens = [], [], 0
        for _ in range(args.requests):
            ttft, tpot, got = generate(stub, prompt, args.output_len)
            ttfts.append(ttft)
            tpots.append(tpot)
            tokens += got
        time.sleep(0.5)
        wall = time.perf_counter() - w0
        m1, cpu1 = metrics(cluster.metrics_ports[name]), thread_cpu(eng)
        s1 = main_thread_sched(eng)
        ch.close()
    finally:
        cluster.stop()
    d = {k: m1[k] - m0[k] for k in COUNTERS}
    steps = max(1.0, d["engine_steps"])
    threads: dict[str, float] = {}  # thread name -> CPU ms per decoded token
    for tid, (tname, cpu) in cpu1.items():
        used = cpu - cpu0.get(tid, (tname, 0.0))[1]
        threads[tname] = threads.get(tname, 0.0) + 1e3 * used / max(1, tokens)
    return {"kind": kind, "tpot_ms_p50": 1e3 * statistics.median(tpots),
            "tpot_ms": [round(1e3 * t, 3) for t in tpots],
            "ttft_ms_p50": 1e3 * statistics.median(ttfts),
            "steps": d["engine_steps"], "mean_batch": d["engine_step_rows"] / steps,
            "step_ms": 1e3 * d["engine_step_seconds"] / steps,
            "gap_ms": 1e3 * d["engine_step_gap_seconds"] / max(1.0, d["engine_step_gaps"]),
            "main_runq_wait_ms_per_token": 1e3 * (s1[1] - s0[1]) / max(1, tokens),
            "main_sleeps_per_token": (s1[2] - s0[2]) / max(1, tokens),
            "engine_cpu_ms_per_token": {k: round(v, 4) for k, v in
                                        sorted(threads.items(), key=lambda kv: -kv[1]) if v},
            "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=6, help="sequential, per kind and round")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, order alternating")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--preset", default="", help="a deploy/benchmark/dummy_model preset "
                   "(e.g. llama3-8b) instead of --hidden/--layers/--vocab")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-mib", type=int, default=64)
    p.add_argument("--devices", default="", help="producer,consumer devices, e.g. "
                   "cuda:0,cuda:1 (the colocated worker runs on the consumer's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--transfer-backend", default="ucx")
    p.add_argument("--worker-arg", action="append", default=[], help="extra engine flag")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="stepbench-")
    model = write_model(os.path.join(tmp, "model"), args.hidden, args.layers, args.vocab,
                        args.preset)
    log_dir = args.log_dir or os.path.join(tmp, "logs")
    results = []
    for r in range(args.rounds):
        for kind in (("pd", "colocated") if r % 2 == 0 else ("colocated", "pd")):
            res = run_kind(kind, args, model, os.path.join(log_dir, f"round{r}"))
            res["round"] = r
            results.append(res)
            print(json.dumps(res), flush=True)
    for kind in ("pd", "colocated"):
        rs = [x for x in results if x["kind"] == kind]
        print(f"{kind:10s} TPOT p50 {statistics.median(x['tpot_ms_p50'] for x in rs):7.3f} ms"
              f"  step {statistics.median(x['step_ms'] for x in rs):6.3f} ms"
              f"  between steps {statistics.median(x['gap_ms'] for x in rs):6.3f} ms"
              f"  loop thread: waits for a core "
              f"{statistics.median(x['main_runq_wait_ms_per_token'] for x in rs):6.3f} ms, "
              f"sleeps {statistics.median(x['main_sleeps_per_token'] for x in rs):5.2f} "
              f"per token")
    pd_t = statistics.median(x["tpot_ms_p50"] for x in results if x["kind"] == "pd")
    co_t = statistics.median(x["tpot_ms_p50"] for x in results if x["kind"] == "colocated")
    print(f"TPOT p50 P/D / colocated: {pd_t / co_t:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "tpot_ratio": pd_t / co_t}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
