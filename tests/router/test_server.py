"""The router over gRPC: validation, registry auth, health, reflection, status, CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pdserve.v1 import common_pb2, router_pb2, worker_pb2
from router_fakes import CO, LENGTH, C, Cluster, FakeWorker, P, run, wait_until

from router.config import RouterConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def expect_status(coro: Any, code: grpc.StatusCode, starts: str = "") -> str:
    try:
        r = await coro
        if hasattr(r, "__aiter__"):
            [x async for x in r]
    except grpc.aio.AioRpcError as e:
        assert e.code() == code, (e.code(), e.details())
        assert (e.details() or "").startswith(starts), e.details()
        return e.details() or ""
    raise AssertionError(f"expected {code}")


async def gen_status(cl: Cluster, req: router_pb2.GenerateRequest) -> tuple[Any, str]:
    try:
        [r async for r in cl.router.Generate(req)]
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def sp(**kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


BAD_REQUESTS = [
    (router_pb2.GenerateRequest(prompt=""), "prompt:"),
    (router_pb2.GenerateRequest(), "input:"),
    (router_pb2.GenerateRequest(prompt="hi " * 300), "prompt: "),  # > max_model_len 256
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(max_tokens=256)), "sampling.max_tokens:"),
    # one limit, one message, whichever side of it
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(max_tokens=0)),
     "sampling.max_tokens: must be in [1, 1048576], got 0"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(max_tokens=2**31)),
     "sampling.max_tokens: must be in [1, 1048576], got 2147483648"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(temperature=-1)), "sampling.temperature:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(top_p=0)), "sampling.top_p:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(min_p=2)), "sampling.min_p:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(seed=2**64 - 1)), "sampling.seed:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(logprobs=50)), "sampling.logprobs:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(stop=[""])), "sampling.stop:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(max_tokens=4, min_tokens=9)),
     "sampling.min_tokens:"),
    (router_pb2.GenerateRequest(prompt="hi", sampling=sp(stop_token_ids=[10**7])),
     "sampling.stop_token_ids[0]:"),
    (router_pb2.GenerateRequest(prompt="hi", model="gpt-4"), "model:"),
    (router_pb2.GenerateRequest(chat=router_pb2.ChatMessages()), "chat.messages:"),
    (router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(messages=[
        router_pb2.ChatMessage(role="wizard", content="x")])), "chat.messages[0].role:"),
    (router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds()), "prompt_token_ids:"),
    (router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[1, 10**7])),
     "prompt_token_ids[1]:"),
    (router_pb2.GenerateRequest(prompt="hi", request_id="x" * 300), "request_id:"),
]


def test_bad_requests_are_invalid_argument_naming_the_field_and_cluster_keeps_serving(
        tokenizer: Any) -> None:
    async def main() -> None:
        async with Cluster() as cl:
            await cl.add("w0", CO, max_model_len=256)
            for req, field in BAD_REQUESTS:
                code, details = await gen_status(cl, req)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
                assert details.startswith(field), (field, details)
            # good requests in every input form still work
            chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user",
                                                                            content="hi")])
            for req in (router_pb2.GenerateRequest(prompt="hi", model="smollm2"),
                        router_pb2.GenerateRequest(chat=chat),
                        router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(
                            ids=[1, 2, 3]))):
                out = [r async for r in cl.router.Generate(req)]
                assert out[-1].finish_reason == LENGTH
            w = cl.workers[0]
            assert list(w.decode_requests[1].prompt_token_ids) == tokenizer.encode_chat(
                [{"role": "user", "content": "hi"}])
            assert list(w.decode_requests[2].prompt_token_ids) == [1, 2, 3]

    run(main())


def test_no_workers_is_unavailable_and_duplicate_id_is_refused() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            code, details = await gen_status(cl, router_pb2.GenerateRequest(prompt="hi"))
            assert code == grpc.StatusCode.UNAVAILABLE and "no workers" in details
            await cl.add("p0", P)  # a producer alone is not enough
            code, _ = await gen_status(cl, router_pb2.GenerateRequest(prompt="hi"))
            assert code == grpc.StatusCode.UNAVAILABLE

            await cl.add("w0", CO)
            cl.workers[-1].decode_script = _hang_decode
            call = cl.router.Generate(router_pb2.GenerateRequest(prompt="hi", request_id="dup"))
            await wait_until(lambda: bool(cl.workers[-1].decode_requests))
            code, details = await gen_status(
                cl, router_pb2.GenerateRequest(prompt="hi", request_id="dup"))
            assert code == grpc.StatusCode.ALREADY_EXISTS and details.startswith("request_id:")
            call.cancel()

    run(main())


async def _hang_decode(w: FakeWorker, req: Any) -> Any:
    await asyncio.sleep(3600)
    yield None


def test_cluster_token_and_fingerprint_checks_on_register() -> None:
    async def main() -> None:
        async with Cluster(cluster_token="s3cret") as cl:
            p = await cl.add("p0", P)  # right token
            w = FakeWorker("c0", C, kv_fingerprint="other")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await cl.add("x0", C, token="wrong")
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (e.value.details() or "").startswith("cluster_token:")
            await expect_status(p.registry.Heartbeat(
                worker_pb2.HeartbeatRequest(
                    worker_id="p0", cluster_token="wrong")),
                grpc.StatusCode.UNAUTHENTICATED, "cluster_token:")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                cl.workers.append(w)
                await w.start(cl.server.address, "s3cret")
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (e.value.details() or "").startswith("kv_fingerprint:")
            await expect_status(w.register("s3cret", model="llama"),
                                grpc.StatusCode.FAILED_PRECONDITION, "model:")
            await expect_status(w.register("s3cret", role=0), grpc.StatusCode.INVALID_ARGUMENT,
                                "role:")

    run(main())


def test_health_status_list_models_and_heartbeat_drop() -> None:
    async def main() -> None:
        async with Cluster() as cl:
            health = health_pb2_grpc.HealthStub(cl.channel)
            serving = health_pb2.HealthCheckResponse.SERVING

            async def status() -> int:
                r = await health.Check(health_pb2.HealthCheckRequest(service=""))
                return r.status

            assert await status() != serving
            p = await cl.add("p0", P)
            assert await status() != serving
            c = await cl.add("c0", C)
            assert await status() == serving
            models = await cl.router.ListModels(router_pb2.ListModelsRequest())
            assert [(m.id, m.max_model_len) for m in models.models] == [("smollm2", 2048)]
            st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert st.policy == "cache_aware"  # the default
            assert [(w.worker_id, w.role, w.healthy) for w in st.workers] == [
                ("c0", C, True), ("p0", P, True)]
            assert st.workers[0].load.kv_blocks_total == 100
            # heartbeats carry load; an orphan-exhausted consumer turns the cluster unhealthy
            c.load.kv_exhausted_by_orphans = True
            await wait_until(lambda: cl.server.registry is not None
                             and not cl.server.registry.serving())
            st = await cl.router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert not st.workers[0].healthy and "orphan" in st.workers[0].unhealthy_reason
            c.load.kv_exhausted_by_orphans = False
            await wait_until(lambda: cl.server.registry is not None
                             and cl.server.registry.serving())
            # silence: dropped after the timeout (0.5 s here), health follows
            p.heartbeating = False
            t0 = time.monotonic()
            await wait_until(lambda: cl.server.registry is not None
                             and cl.server.registry.get("p0") is None)
            assert 0.3 < time.monotonic() - t0 < 2.0
            for _ in range(50):
                if await status() != serving:
                    break
                await asyncio.sleep(0.02)
            assert await status() != serving
            # heartbeating again: known=false, so it re-registers by itself
            p.heartbeating = True
            await wait_until(lambda: cl.server.registry is not None
                             and cl.server.registry.get("p0") is not None)
            # reflection lists the services
            refl = reflection_pb2_grpc.ServerReflectionStub(cl.channel)
            call = refl.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            names = {s.name for s in resp.list_services_response.service}
            assert {"pdserve.v1.Router", "pdserve.v1.Registry", "grpc.health.v1.Health"} <= names

    run(main())


@pytest.mark.parametrize("kw,flag", [
    (dict(policy="random"), "--policy"), (dict(grpc_port=70000), "--grpc-port"),
    (dict(heartbeat_timeout_s=0.5), "--heartbeat-timeout"),
    (dict(token0_timeout_s=0), "--token0-timeout"), (dict(bind_host=""), "--bind-host"),
    (dict(prefill_retries=-1), "--prefill-retries"),
])
def test_config_errors_name_the_flag(kw: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag}:"):
        RouterConfig(**kw)


CLI = """
import argparse, sys, time
t0 = time.monotonic()
from deploy.router_cmd import add_router_parser
p = argparse.ArgumentParser(prog="pdserve")
add_router_parser(p.add_subparsers(dest="command", required=True))
args = p.parse_args(sys.argv[1:])
rc = args.func(args)
assert "torch" not in sys.modules, "the router imported torch"
sys.exit(rc)
"""


def test_cli_starts_fast_without_torch_and_stops_on_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", CLI, "router", "--grpc-port", "0",
                                 "--policy", "power_of_two", "--log-level", "WARNING"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            started = time.monotonic() - t0
            assert line.startswith("pdserve router: gRPC 127.0.0.1:"), line
            assert "power_of_two" in line
            # Interpreter + grpc + tokenizer load; the budget leaves room for a busy CI box.
            assert started < 5.0, started
            proc.send_signal(sig)
            assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# What makes a process slow to start and large (a router frontend is one process per
# core): none of it may be imported by the router. Asserted on the modules, not on a time,
# which a loaded CI machine stretched past any fixed bound (0.24 s idle, 1.19 s at load 10).
HEAVY = ("torch", "transformers", "triton", "numpy", "safetensors", "ucxx", "zmq", "engine.llm")


def test_router_modules_import_without_the_engines_stack() -> None:
    code = ("import sys; import router.server, router.requests.dispatcher, "
            "router.control.policy, router.requests.validation, deploy.router_cmd; "
            f"print(sorted({{h for h in {HEAVY!r} for m in sys.modules "
            "if m == h or m.startswith(h + '.')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the router imported {out.stdout.strip()}"
