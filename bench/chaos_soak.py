"""Chaos soak: the chaos test's driver for longer, with a JSON record.

    python bench/chaos_soak.py [--duration 600] [--seed N] [--clients 4] [--net netns|host]
                               [--out FILE.json]

Starts a 2P2D cluster on this machine (SmolLM2 on CPU), computes the colocated engine's
tokens for each request case in-process, then runs steady load for ``--duration`` seconds
while SIGKILL / SIGSTOP of workers and hostile frames at KV ports are injected
(tests/chaos/chaos_driver.py). With ``--net netns`` (the default; needs root) every worker
runs in its own network namespace on a bridge, KV over UCX on TCP, and link faults are
injected too: veth down/up, partitions (nftables drop rules, or ``ip route prohibit``
without nft) and tc tbf rate limits (tests/chaos/link_faults.py). Writes: requests sent,
faults injected by kind, requests recovered and failed (with reasons), leaked KV blocks per
worker after quiescing, p50/p99 recovery time, and every broken invariant. Exit status 1
when an invariant broke.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from chaos.chaos_driver import ChaosRun, reference_cases  # noqa: E402
from chaos.link_faults import WORKERS_2P2D, netns_spec  # noqa: E402
from live_cluster import WORKER_ARGS  # noqa: E402
from netns_hosts import NetHub  # noqa: E402

from deploy.cluster import ClusterSpec, LocalCluster  # noqa: E402

ROUTER_ARGS = ("--heartbeat-timeout", "2", "--token0-timeout", "40", "--token-timeout", "20",
               "--max-migrations", "3", "--prefill-retries", "3")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--clients", type=int, default=4, help="concurrent client loops")
    ap.add_argument("--fault-every", type=float, default=8.0, help="seconds between faults")
    ap.add_argument("--deadline", type=float, default=90.0, help="each request's deadline (s)")
    ap.add_argument("--net", choices=("netns", "host"), default="netns",
                    help="netns: each worker its own network namespace, link faults too")
    ap.add_argument("--out", default="bench/results/chaos_soak.json")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    from engine.llm import LLM

    t0 = time.monotonic()
    cases = reference_cases(LLM(None, max_num_batched_tokens=128))
    log_dir = tempfile.mkdtemp(prefix="chaos-soak-")
    hub = None
    if args.net == "netns":
        hub = NetHub("pdcs", "10.213.8.0", WORKERS_2P2D)
        hub.up()  # raises HubUnavailable with the reason (run with --net host there)
        spec = netns_spec(hub, WORKER_ARGS, ROUTER_ARGS)
    else:
        spec = ClusterSpec(producers=2, consumers=2, worker_args=WORKER_ARGS,
                           router_args=ROUTER_ARGS)
    cluster = LocalCluster(spec, log_dir=log_dir)
    try:
        cluster.start()
        run = ChaosRun(cluster, cases, seed=seed, clients=args.clients,
                       deadline_s=args.deadline, fault_every_s=args.fault_every, hub=hub)
        t_load = time.monotonic()
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load_before = [round(x, 2) for x in os.getloadavg()]
        run.run(args.duration)
        load_s = time.monotonic() - t_load
        leaked = run.quiesce(timeout_s=150.0)
        record = {"duration_s": args.duration, "load_s": round(load_s, 1),
                  "setup_s": round(t_load - t0, 1), "clients": args.clients,
                  "cluster": "2P2D, SmolLM2-135M on CPU, ucx", "log_dir": log_dir,
                  "started": started, "cpus": os.cpu_count(),
                  "load_average_at_start": load_before,
                  "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                  **run.record(leaked)}
    finally:
        cluster.stop()
        if hub is not None:
            hub.down()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    summary = {k: v for k, v in record.items() if k != "faults"}
    print(json.dumps(summary, indent=1))
    return 1 if record["violations"] or any(record["leaked_blocks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
