"""The router's OpenAI-compatible HTTP API: streamed ``/v1/completions`` over SSE.

The prompt goes as a list of token ids (the OpenAI wire format allows it) so lengths are
exact; ``stream_options.include_usage`` gives the completion token count at the end. Each
SSE chunk with a choice counts as one token-bearing message (the format carries no
per-chunk token count), as in vLLM's client.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec
from deploy.router_client import API_KEY_ENV, RouterError


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, base_url: str, model: str | None = None,
                 status_address: str | None = None, api_key: str = "",
                 router_ca: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model = model
        self.status_address = status_address  # the router's gRPC address, for worker counts
        self.api_key = api_key
        self.router_ca = router_ca  # CA of an https:// router (and of its gRPC TLS)
        self._session: Any = None

    async def open(self) -> None:
        try:
            import aiohttp
        except ImportError:
            raise ValueError("--backend openai needs the 'aiohttp' package "
                             "(pip install aiohttp)") from None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        connector = None
        if self.router_ca:
            import ssl

            connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(
                cafile=self.router_ca))
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                              headers=headers, connector=connector)
        if self.model is None:
            try:
                async with self._session.get(f"{self.base_url}/models") as resp:
                    body = await resp.text()
                    if resp.status == 401:
                        raise RouterError(
                            f"the router at {self.base_url} refused the call: HTTP 401 "
                            f"(pass its key with --api-key or ${API_KEY_ENV})")
                    if resp.status != 200:
                        raise RouterError(f"GET {self.base_url}/models: HTTP {resp.status}: "
                                          f"{' '.join(body[:200].split())}")
                    self.model = json.loads(body)["data"][0]["id"]
            except aiohttp.ClientError as e:
                await self.close()
                raise RouterError(f"cannot reach the router at {self.base_url}: {e}") from None
            except RouterError:
                await self.close()
                raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def workers(self) -> int:
        if not self.status_address:
            return 0
        from deploy.benchmark.grpc_backend import GrpcBackend

        g = GrpcBackend(self.status_address, self.api_key, self.router_ca)
        await g.open()
        try:
            return await g.workers()
        finally:
            await g.close()

    def _payload(self, spec: RequestSpec, sampling: SamplingChoice) -> dict[str, Any]:
        return {"model": self.model, "prompt": list(spec.prompt_ids),
                "max_tokens": spec.output_len, "temperature": sampling.temperature,
                "ignore_eos": sampling.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}

    async def send(self, spec: RequestSpec, rec: RequestRecord,
                   sampling: SamplingChoice) -> None:
        import aiohttp

        counted = 0
        rec.start = time.perf_counter()
        try:
            async with self._session.post(
                    f"{self.base_url}/completions", json=self._payload(spec, sampling),
                    timeout=aiohttp.ClientTimeout(total=sampling.timeout_s)) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                else:
                    counted = await self._read_stream(resp, rec)
        except (aiohttp.ClientError, TimeoutError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.end = time.perf_counter()
        rec.output_tokens = counted
        if not rec.error and not rec.finish_reason:
            rec.error = "stream ended without a finish reason"
        rec.success = not rec.error

    async def _read_stream(self, resp: Any, rec: RequestRecord) -> int:
        """Consumes the SSE stream; returns the completion token count."""
        counted = 0
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                continue
            choices = chunk.get("choices") or []
            if choices:
                reason = choices[0].get("finish_reason")
                # A chunk that only closes the stream (no text) carries no token.
                if choices[0].get("text") or not reason:
                    rec.arrivals.append((time.perf_counter(), 1))
                    counted += 1
                if reason:
                    rec.finish_reason = str(reason)
            usage = chunk.get("usage")
            if usage:
                counted = int(usage.get("completion_tokens") or counted)
                rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
                details = usage.get("prompt_tokens_details") or {}
                rec.cached_tokens = int(details.get("cached_tokens") or 0)
        return counted
