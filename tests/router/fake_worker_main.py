"""A scripted consumer in its own process, so a test can SIGKILL it like a crashed worker.

Usage: python fake_worker_main.py ROUTER_ADDR WORKER_ID. It reserves, streams one token,
then stalls; prints "ready" once registered.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from router_fakes import C, FakeWorker, reserved, tokens  # noqa: E402


async def one_token_then_stall(w: FakeWorker, req: Any) -> Any:
    yield reserved()
    yield tokens([101], "B")
    await asyncio.sleep(3600)


async def main(router_address: str, worker_id: str) -> None:
    w = FakeWorker(worker_id, C, decode=one_token_then_stall)
    await w.start(router_address)
    print("ready", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
