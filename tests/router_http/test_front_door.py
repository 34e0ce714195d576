"""HTTP front door, health, auth, TLS and backpressure on an in-process router whose
workers are scripted fakes (no model: fast, and failure states are easy to stage)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from typing import Any

import aiohttp
import grpc
from certs import make_cert
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.v1 import router_pb2, router_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import (
    Cluster,
    FakeWorker,
    load_tokenizer,
    next_destination,
    request,
    reserved,
    run,
    token0,
    tokens,
    transfer,
    wait_until,
)

from router.config import RouterConfig
from router.server import RouterServer

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def post(cl: Cluster, path: str, body: Any, **kw: Any) -> tuple[int, Any, Any]:
    url = f"http://127.0.0.1:{cl.server.http_port}{path}"
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text), r.headers
        except ValueError:
            return r.status, text, r.headers


async def get(cl: Cluster, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{cl.server.http_port}{path}") as r:
        text = await r.text()
        return r.status, (json.loads(text) if "json" in r.content_type else text)


def test_health_follows_workers_and_orphan_exhaustion() -> None:
    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            status, body = await get(cl, "/health")
            assert status == 503 and "0 producer(s), 0 consumer(s)" in body["reason"]
            code, err, _ = await post(cl, "/v1/chat/completions", CHAT)
            assert code == 503 and err["error"]["code"] == "no_workers"
            _, c = await cl.pd()
            status, body = await get(cl, "/health")
            assert status == 200 and body["status"] == "ok"
            c.load.kv_exhausted_by_orphans = True  # what a wedged consumer reports
            health = health_pb2_grpc.HealthStub(cl.channel)
            await wait_until(lambda: not cl.server.registry.serving(), 3.0)  # type: ignore[union-attr]
            status, body = await get(cl, "/health")
            assert status == 503
            assert "consumer c0: KV pool exhausted by orphaned requests" in body["reason"]
            r = await health.Check(health_pb2.HealthCheckRequest())
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            c.load.kv_exhausted_by_orphans = False
            await wait_until(lambda: cl.server.registry.serving(), 3.0)  # type: ignore[union-attr]
            assert (await get(cl, "/health"))[0] == 200

    run(main())


def test_chat_and_completions_over_fakes_stream_and_not() -> None:
    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            await cl.pd()
            code, body, _ = await post(cl, "/v1/chat/completions", CHAT)
            assert code == 200, body
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "ABCD"}
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 4
            assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
            code, body, _ = await post(cl, "/v1/completions", {"prompt": "x", "stream": True,
                                                               "stream_options": {
                                                                   "include_usage": True}})
            events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "ABCD"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
            code, err, _ = await post(cl, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
            assert code == 404 and err["error"]["code"] == "model_not_found"
            code, err, _ = await post(cl, "/v1/completions", {"prompt": "x", "top_p": 0})
            assert code == 400 and err["error"]["param"] == "top_p"
            code, err, _ = await post(cl, "/v1/chat/completions",
                                      {"messages": [{"role": "wizard", "content": "x"}]})
            assert code == 400 and err["error"]["param"] == "messages[0].role"
            code, err, _ = await post(cl, "/v1/completions", {"prompt": "x", "n": 3})
            assert code == 400 and err["error"]["param"] == "n"
            code, err, _ = await post(cl, "/v1/nothing", {})
            assert code == 404 and "error" in err
            status, text = await get(cl, "/metrics")
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            outcomes = {(s.labels["api"], s.labels["outcome"]): s.value
                        for s in fams["pdserve_router_requests"].samples
                        if s.name.endswith("_total")}
            assert outcomes[("http", "length")] == 2
            assert outcomes[("http", "invalid_argument")] == 3
            assert outcomes[("http", "not_found")] == 1
            ttft = fams["pdserve_router_time_to_first_token_seconds"].samples
            assert [s.value for s in ttft if s.name.endswith("_count")] == [2]
            assert (await get(cl, "/openapi.json"))[1]["openapi"].startswith("3.")

    run(main())


def test_past_the_queue_bound_requests_get_429_and_resource_exhausted() -> None:
    release = asyncio.Event()

    async def slow_decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        await release.wait()
        yield tokens([101], "B", 2)

    async def main() -> None:
        async with Cluster(http_port=0, max_running_requests=1, max_queued_requests=1,
                           retry_after_s=2.0) as cl:
            await cl.pd(decode=slow_decode)
            held = [asyncio.create_task(post(cl, "/v1/chat/completions", CHAT)) for _ in range(2)]
            await wait_until(lambda: cl.server.admission.queued == 1)  # type: ignore[union-attr]
            code, err, headers = await post(cl, "/v1/chat/completions", CHAT)
            assert code == 429 and headers["Retry-After"] == "2", err
            assert "--max-queued-requests 1" in err["error"]["message"]
            call = cl.router.Generate(request())
            try:
                [r async for r in call]
                raise AssertionError("expected RESOURCE_EXHAUSTED")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                md = dict(e.trailing_metadata() or ())
                assert md["retry-after"] == "2" and md["grpc-retry-pushback-ms"] == "2000"
            release.set()
            assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]
            code, _, _ = await post(cl, "/v1/chat/completions", CHAT)  # recovered
            assert code == 200
            assert (cl.server.admission.running, cl.server.admission.queued) == (0, 0)  # type: ignore[union-attr]

    run(main())


def test_tls_and_api_key_on_both_front_doors(tmp_path: Any) -> None:
    cert, key = make_cert(str(tmp_path))

    async def main() -> None:
        cfg = RouterConfig(grpc_port=0, http_port=0, api_key="sesame", tls_cert=cert,
                           tls_key=key)
        server = RouterServer(cfg, tokenizer=load_tokenizer())
        await server.start()
        try:
            ctx = ssl.create_default_context(cafile=cert)
            base = f"https://127.0.0.1:{server.http_port}"
            async with aiohttp.ClientSession() as s:
                for headers, want in (({}, 401), ({"Authorization": "Bearer nope"}, 401),
                                      ({"Authorization": "Bearer sesame"}, 200)):
                    async with s.get(f"{base}/v1/models", ssl=ctx, headers=headers) as r:
                        assert r.status == want, await r.text()
                        if want == 401:
                            assert (await r.json())["error"]["type"] == "authentication_error"
                async with s.get(f"{base}/health", ssl=ctx) as r:  # probes need no key
                    assert r.status == 503
                try:  # plaintext to the TLS port gets nowhere
                    async with s.get(f"http://127.0.0.1:{server.http_port}/health") as r:
                        assert r.status >= 400
                except aiohttp.ClientError:
                    pass
            with open(cert, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            async with grpc.aio.secure_channel(server.address, creds) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                for md in ((), (("authorization", "Bearer nope"),)):
                    try:
                        await stub.ListModels(router_pb2.ListModelsRequest(), metadata=md)
                        raise AssertionError("expected UNAUTHENTICATED")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                try:
                    [r async for r in stub.Generate(request())]
                    raise AssertionError("expected UNAUTHENTICATED")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                r = await stub.ListModels(router_pb2.ListModelsRequest(),
                                          metadata=(("authorization", "Bearer sesame"),))
                assert r.models[0].id == "smollm2"
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert h.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.stop(0.1)

    run(main())


def test_debug_requests_lists_a_live_request_behind_the_api_key() -> None:
    release = asyncio.Event()

    async def decode(w: FakeWorker, req: Any) -> Any:
        yield reserved()
        yield tokens([101], "B", kv_ready_ns=1, first_step_ns=2)
        await release.wait()
        yield tokens([102], "C", 2)

    async def main() -> None:
        async with Cluster(http_port=0, api_key="sesame") as cl:
            await cl.pd(decode=decode)
            auth = {"Authorization": "Bearer sesame"}
            held = asyncio.create_task(post(cl, "/v1/completions",
                                            {"prompt": "hi", "max_tokens": 4}, headers=auth))
            url = f"http://127.0.0.1:{cl.server.http_port}/debug/requests"
            async with aiohttp.ClientSession() as s:
                async with s.get(url) as r:  # no key: refused, like /v1/*
                    assert r.status == 401
                    assert (await r.json())["error"]["type"] == "authentication_error"
                rows: list[Any] = []
                # The state moves when a leg reads a message, tokens_streamed when the client
                # loop has handed them on, a moment later: wait for both (CI once saw
                # DECODING with 0 streamed).
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    async with s.get(url, headers=auth) as r:
                        assert r.status == 200
                        rows = (await r.json())["data"]
                    if rows and rows[0]["state"] == "DECODING" and rows[0]["tokens_streamed"] == 2:
                        break
                    await asyncio.sleep(0.01)
                (row,) = rows
                assert row["state"] == "DECODING", row
                assert (row["producer"], row["consumer"], row["colocated"]) == ("p0", "c0", "")
                assert row["tokens_streamed"] == 2 and row["age_s"] > 0
                assert row["request_id"]  # the id the router made for it
                release.set()
                code, body, _ = await held
                assert code == 200 and body["choices"][0]["finish_reason"] == "length"
                async with s.get(url, headers=auth) as r:
                    assert (await r.json())["data"] == []
                doc = (await get(cl, "/openapi.json"))[1]
                assert "/debug/requests" in doc["paths"]

    run(main())


def test_cached_prompt_tokens_reach_both_doors_usage() -> None:
    """The producer's prefix-cache hits (Token0.cached_tokens) are
    usage.cached_tokens on gRPC and usage.prompt_tokens_details.cached_tokens on HTTP,
    streamed (include_usage) or not."""
    async def cached_prefill(w: Any, req: Any, inputs: Any) -> Any:
        yield token0(cached_tokens=32)
        await next_destination(w, inputs)
        yield transfer()

    async def main() -> None:
        async with Cluster(http_port=0) as cl:
            await cl.pd(prefill=cached_prefill)
            final = (await cl.generate(max_tokens=4))[-1]
            assert final.usage.cached_tokens == 32, final.usage
            code, body, _ = await post(cl, "/v1/chat/completions", CHAT)
            assert code == 200 and body["usage"]["prompt_tokens_details"] == {
                "cached_tokens": 32}, body
            code, text, _ = await post(cl, "/v1/completions", {
                "prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
            events = [json.loads(ln[6:]) for ln in text.splitlines()
                      if ln.startswith("data: {")]
            assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    run(main())
