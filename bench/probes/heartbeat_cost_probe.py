"""What a worker's heartbeat process (worker/heartbeat_process.py) costs: its CPU a second
and its resident memory, against a real router on this process's loop, with a new load
report every 0.25 s (the engine's cadence) and the router's 1 s heartbeat interval.

The memory is an upper bound: a spawned child imports its parent's main module, and this
script's imports the router; a worker's (deploy.cli) imports little.

    python bench/probes/heartbeat_cost_probe.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

from engine.model_source import resolve_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.server import RouterServer  # noqa: E402
from worker.load_report import LoadReport  # noqa: E402
from worker.messages import ReadyInfo  # noqa: E402
from worker.registration import Registration  # noqa: E402


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0])


async def main(seconds: float) -> None:
    server = RouterServer(RouterConfig(grpc_port=0, heartbeat_interval_s=1.0),
                          tokenizer=Tokenizer.from_source(resolve_model(None)))
    await server.start()
    report = [LoadReport(1, 2, 3, 4)]
    reg = Registration(server.address, "w", "consumer", "127.0.0.1:1",
                       ReadyInfo("smollm2", "fp", 256, kv_address="tcp://127.0.0.1:1"),
                       lambda: report[0])
    task = asyncio.create_task(reg.run())
    try:
        assert server.registry is not None
        while server.registry.get("w") is None:
            await asyncio.sleep(0.05)
        pid = reg._proc.pid
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        while time.monotonic() - t0 < seconds:
            report[0] = LoadReport(1, 2, 3, 4)  # a new report object, as the engine sends
            await asyncio.sleep(0.25)
        cpu1, t1 = _cpu_s(pid), time.monotonic()
        print(f"heartbeat process: {1000 * (cpu1 - cpu0) / (t1 - t0):.2f} ms of CPU a second "
              f"over {t1 - t0:.0f} s; RSS {_rss_kb(pid) / 1024:.0f} MiB")
    finally:
        task.cancel()
        await reg.close()
        await server.stop(0)


if __name__ == "__main__":  # the spawned heartbeat process imports this module too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    asyncio.run(main(ap.parse_args().seconds))
