"""Simulated engines behind a real router: a colocated worker and a 1P1D pair serve requests
end to end (gRPC, engine processes, KV transfer over UCX, detokenization), at the configured
step time, and the pair gives the colocated worker's tokens. The colocated worker's gRPC
process runs on asyncio's loop and serves its outputs on the Outputs RPC only
(--outputs-port -1); the pair's run on the default (uvloop where installed) and the
router reads the consumer's outputs from its Unix socket (the router is on its host); the
pair's producer runs with --no-outputs-unix and advertises its TCP port only."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cluster_client import Result, generate, stub_for
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2

from deploy.benchmark.dummy_model import write_dummy_model
from deploy.cluster import LocalCluster
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sim_config import SimConfig

pytestmark = pytest.mark.slow  # two live clusters
STEP_MS = 10
SIM_ARGS = ("--simulate-step-ms", str(STEP_MS), "--max-num-batched-tokens", "128",
            "--kv-cache-mib", "16")
PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 40, 130, 17, 64, 9))]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_dummy_model(str(tmp_path_factory.mktemp("simmodel")), "tiny")


def _cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: str, name: str,
             extra: tuple[str, ...] = (), **kw: object) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, name, model=model_dir, worker_args=SIM_ARGS + extra,
                      **kw)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def sim_pd(tmp_path_factory, model_dir):  # type: ignore[no-untyped-def]
    yield from _cluster(tmp_path_factory, model_dir, "simpd",
                        producer_args=("--no-outputs-unix",))


@pytest.fixture(scope="module")
def sim_colocated(tmp_path_factory, model_dir):  # type: ignore[no-untyped-def]
    yield from _cluster(tmp_path_factory, model_dir, "simco",
                        ("--event-loop", "asyncio", "--outputs-port", "-1"),
                        producers=0, consumers=0, colocated=1)


def _timed(address: str, i: int) -> tuple[Result, float]:
    ch, stub = stub_for(address)
    with ch:
        t0 = time.monotonic()
        r = generate(stub, dict(max_tokens=MAX_TOKENS, seed=500 + i),
                     prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[i]))
        return r, time.monotonic() - t0


def _serve_all(cluster: LocalCluster) -> list[tuple[Result, float]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda i: _timed(cluster.router_address, i), range(len(PROMPTS))))


def _check(cluster: LocalCluster, results: list[tuple[Result, float]]) -> None:
    for i, (r, took) in enumerate(results):
        assert r.code is None and r.error == "", (i, r.code, r.details, r.error,
                                                  dump_logs(cluster))
        assert len(r.token_ids) == MAX_TOKENS, i
        assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH, i
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.text.split() == [f"t{t}" for t in r.token_ids]  # the served tokenizer
        # one simulated step per token at least (the producer's step samples token 0)
        assert took >= (MAX_TOKENS - 1) * STEP_MS / 1e3, (i, took)


def _reference(model_dir: str) -> list[list[int]]:
    llm = LLM(model_dir, simulate=SimConfig(step_ms=0))
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, seed=500 + i)
                                  for i in range(len(PROMPTS))])
    return [c.token_ids for c in outs]


def test_colocated_and_pd_serve_the_same_tokens(sim_colocated, sim_pd, model_dir):
    co = _serve_all(sim_colocated)
    _check(sim_colocated, co)
    pd = _serve_all(sim_pd)
    _check(sim_pd, pd)
    for r in (r for r, _ in pd):
        assert r.timing.producer and r.timing.consumer and not r.timing.colocated
    assert [r.token_ids for r, _ in pd] == [r.token_ids for r, _ in co] == _reference(model_dir)
    # each path was the one its workers offered
    assert _outputs_transports(sim_colocated) == {"colocated": ("", "", "grpc")}
    transports = _outputs_transports(sim_pd)
    address, unix, how = transports["consumer"]
    assert address and unix.startswith("@pdserve-outputs-") and how == "unix", transports
    # --no-outputs-unix: the TCP port only (producers have no Outputs stream open)
    p_address, p_unix, _ = transports["producer"]
    assert p_address and p_unix == "", transports


def _outputs_transports(cluster: LocalCluster) -> dict[str, tuple[str, str, str]]:
    """Role -> (the outputs address and Unix socket it registered, how the router reads its
    outputs now), from the router's ClusterStatus."""
    ch, stub = stub_for(cluster.router_address)
    with ch:
        status = stub.ClusterStatus(router_pb2.ClusterStatusRequest())
    return {common_pb2.Role.Name(w.role).removeprefix("ROLE_").lower():
            (w.outputs_address, w.outputs_unix, w.outputs_transport) for w in status.workers}


def test_step_time_is_honoured_under_load(sim_pd):
    # 24 requests in flight share each 10 ms step: the run takes ~MAX_TOKENS steps, not 24x
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        res = list(pool.map(lambda i: _timed(sim_pd.router_address, i % len(PROMPTS)),
                            range(24)))
    took = time.monotonic() - t0
    assert all(len(r.token_ids) == MAX_TOKENS for r, _ in res), dump_logs(sim_pd)
    assert (MAX_TOKENS - 1) * STEP_MS / 1e3 <= took < 10, took
