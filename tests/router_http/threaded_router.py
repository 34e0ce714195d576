"""A real router on scripted fake workers (router_fakes), served from a thread's event loop
so that blocking clients (urllib, hypothesis, the `pdserve` commands) can drive it."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from typing import Any

from router_fakes import Cluster


class ThreadedRouter:
    """A router with one fake producer and consumer, served from a thread's event loop so
    blocking clients (and hypothesis) can drive it."""

    def __init__(self, **config: Any) -> None:
        self.config = config  # RouterConfig fields (api_key=...)
        self.ready = threading.Event()
        self.port = 0
        self.grpc_address = ""
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with Cluster(http_port=0, **self.config) as cl:
                await cl.pd()
                self.port = cl.server.http_port  # type: ignore[assignment]
                self.grpc_address = cl.server.address
                self.ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            self.ready.set()

    def start(self) -> None:
        self._thread.start()
        assert self.ready.wait(30), "router did not start"
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        # ensure_ascii: a lone surrogate travels as the escape "\ud800", as a client's
        # JSON encoder writes it (the raw code point cannot be UTF-8 encoded at all)
        data = json.dumps(body, ensure_ascii=True).encode() if not isinstance(body, bytes) \
            else body
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
