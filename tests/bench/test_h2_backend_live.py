"""The hand-framed gRPC client (deploy/benchmark/h2_grpc_backend.py) against a live 1P1D
cluster, on the router's grpc.aio port and on its hand-framed door: the same records as
grpcio's client (tokens, finish, usage, server timing), the same error strings for a bad
request, the server's deadline, an API key, and many streams on one connection."""

from __future__ import annotations

import asyncio
import math

import pytest
from live_cluster import dump_logs, start_cluster

from deploy.benchmark.backend import SamplingChoice
from deploy.benchmark.grpc_backend import GrpcBackend
from deploy.benchmark.h2_grpc_backend import H2GrpcBackend
from deploy.benchmark.load import LoadPoint, run_requests
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec
from deploy.ports import free_port

pytestmark = pytest.mark.slow
KEY = "h2-test-key"
SPECS = [RequestSpec(tuple(range(1000, 1000 + 40 + 7 * i)), 5 + i) for i in range(6)]
BAD = RequestSpec((10**7,), 4)  # outside the vocabulary: INVALID_ARGUMENT


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    stream = free_port("127.0.0.1")
    c = start_cluster(tmp_path_factory, "h2client", api_key=KEY,
                      router_args=("--grpc-stream-port", str(stream)))
    c.stream_address = f"127.0.0.1:{stream}"  # type: ignore[attr-defined]
    yield c
    c.stop()


def _run(backend, specs, sampling, concurrency=3):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        await backend.open()
        try:
            return await run_requests(backend, specs, LoadPoint(concurrency, math.inf),
                                      sampling, seed=0)
        finally:
            await backend.close()
    return asyncio.run(go())[0]


def _seen(r: RequestRecord) -> tuple:  # type: ignore[type-arg]
    return (r.success, r.error, r.finish_reason, r.output_tokens, r.prompt_len,
            sum(n for _, n in r.arrivals), r.hold_ms is not None, r.prefill_ms is not None,
            r.first_step_wait_ms is not None)


@pytest.mark.parametrize("door", ["grpc", "stream"])
def test_the_same_records_as_grpcio(cluster, door):  # type: ignore[no-untyped-def]
    address = cluster.router_address if door == "grpc" else cluster.stream_address
    sampling = SamplingChoice(ignore_eos=True, timeout_s=60)
    want = _run(GrpcBackend(address, api_key=KEY), [*SPECS, BAD], sampling)
    got = _run(H2GrpcBackend(address, api_key=KEY), [*SPECS, BAD], sampling)
    assert [_seen(r) for r in got] == [_seen(r) for r in want], dump_logs(cluster)
    assert all(r.success for r in got[:-1])
    assert [r.output_tokens for r in got[:-1]] == [s.output_len for s in SPECS]
    assert got[-1].error.startswith("INVALID_ARGUMENT: ") and "prompt_token_ids" in got[-1].error


def test_many_streams_share_one_connection(cluster):  # type: ignore[no-untyped-def]
    specs = [RequestSpec(tuple(range(2000 + i, 2030 + i)), 8) for i in range(48)]
    got = _run(H2GrpcBackend(cluster.stream_address, api_key=KEY), specs,
               SamplingChoice(ignore_eos=True, timeout_s=60), concurrency=48)
    assert all(r.success and r.output_tokens == 8 for r in got), \
        ([r.error for r in got if not r.success][:3], dump_logs(cluster))


def test_a_missing_key_and_the_servers_deadline(cluster):  # type: ignore[no-untyped-def]
    spec = [RequestSpec(tuple(range(3000, 3040)), 4)]
    (r,) = _run(H2GrpcBackend(cluster.router_address), spec,
                SamplingChoice(ignore_eos=True, timeout_s=60))
    assert r.error.startswith("UNAUTHENTICATED: ") and not r.success
    # a deadline far shorter than the output: the router ends the call
    (r,) = _run(H2GrpcBackend(cluster.stream_address, api_key=KEY),
                [RequestSpec(tuple(range(3000, 3040)), 1400)],
                SamplingChoice(ignore_eos=True, timeout_s=0.2))
    assert r.error.startswith("DEADLINE_EXCEEDED") and not r.success


def test_no_router_is_a_clear_error():
    from deploy.router_client import RouterError

    b = H2GrpcBackend(f"127.0.0.1:{free_port('127.0.0.1')}")
    with pytest.raises(RouterError, match="127.0.0.1"):
        asyncio.run(b.open())
    with pytest.raises(RouterError, match="cleartext"):
        H2GrpcBackend("127.0.0.1:1", router_ca="ca.pem")


def test_grpcio_backend_asks_the_main_port_for_workers(cluster):  # type: ignore[no-untyped-def]
    """The hand-framed door serves Generate only: ClusterStatus there is UNIMPLEMENTED, so
    `pdserve bench --router DOOR --status-router MAIN` asks the main port for the workers."""
    from deploy.router_client import RouterError

    async def workers(b):  # type: ignore[no-untyped-def]
        await b.open()
        try:
            return await b.workers()
        finally:
            await b.close()

    with pytest.raises(RouterError, match="UNIMPLEMENTED"):
        asyncio.run(workers(GrpcBackend(cluster.stream_address, api_key=KEY)))
    b = GrpcBackend(cluster.stream_address, api_key=KEY, status_address=cluster.router_address)
    assert asyncio.run(workers(b)) == 2  # 1P1D
    (r,) = _run(b, SPECS[:1], SamplingChoice(ignore_eos=True, timeout_s=60))
    assert r.success and r.output_tokens == SPECS[0].output_len  # Generate on the door
