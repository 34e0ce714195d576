"""P/D across attention data-parallel layouts, in live clusters (router, gRPC workers, their
engine processes and follower ranks, UCX transfers) on a tiny random DeepSeek-V3 (MLA
latent cache + MoE, experts over both ranks of a worker): producer DPA-TP2 -> consumer
DPA-TP2, TP2 -> DPA-TP2 and DPA-TP2 -> TP2.

Greedy and seeded tokens equal the colocated single-rank engine's through the router (its
concurrent requests spread over both groups of each side), and greedy tokens equal it with
every (producer group, consumer group) pair driven by hand and with every request on one
group of each side. The address a consumer gives the producer names its group's rank(s)
only; a group the worker does not have is an error naming the field, and the workers
serve on. The per-rank byte counts (an idle rank moves nothing) are asserted in
tests/transfer/test_dp_endpoints.py on the same endpoints.

Killing the rank of one group of a DPA-TP2 consumer mid-decode takes that worker down as
a whole, as a TP rank's death does: each of its requests (both groups') ends with an error
naming it or migrates to the other consumer with the same tokens, and nothing hangs.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pd_direct import pd_request
from pd_identity import ENGINE, assert_cluster_matches, colocated_tokens
from pdserve.v1 import router_pb2
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import PROMPTS, byte_tokenizer

from deploy.procs import cmdline
from transfer.tp_endpoints import split_addresses

SEED = 700
GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
LAYOUTS = {  # name: (producer groups, consumer groups); every worker has two ranks
    "p-dpa-tp2-d-dpa-tp2": (2, 2),
    "p-tp2-d-dpa-tp2": (1, 2),
    "p-dpa-tp2-d-tp2": (2, 1),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    version, kw = MODELS["v3"]
    path = make_tiny_deepseek(str(tmp_path_factory.mktemp("dpa") / "v3"), version, seed=5,
                              **kw)
    byte_tokenizer(path)
    return path, colocated_tokens(path, SEED)


def _direct(c, pairs: list[tuple[int, int]], pd: int, cd: int, tag: str) -> list:
    """Every prompt at once, prompt i on producer group pairs[i][0] and consumer group
    pairs[i][1] (None for a worker of one group)."""
    status = {w.worker_id: w for w in c.status(30).workers}
    p, cons = status["worker-0"], status["worker-1"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(pd_request, p.address, cons.address, "worker-1", f"{tag}-{i}",
                            prompt, GREEDY, 2 // pd,
                            pairs[i][0] if pd > 1 else None,
                            pairs[i][1] if cd > 1 else None)
                for i, prompt in enumerate(PROMPTS)]
        return [f.result() for f in futs]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dp_layouts_pair_and_tokens_equal_the_single_rank_engine(tmp_path_factory, model,
                                                                name):
    path, refs = model
    pd, cd = LAYOUTS[name]
    c = start_cluster(tmp_path_factory, name, model=path, producers=1, consumers=1,
                      transfer_backend="ucx",
                      worker_args=(*ENGINE, "--tensor-parallel-size", "2",
                                   "--data-parallel-size", str(cd)),
                      producer_args=("--data-parallel-size", str(pd)))
    try:
        status = {w.worker_id: w for w in c.status(30).workers}
        consumer_ranks = split_addresses(status["worker-1"].kv_address)
        assert len(consumer_ranks) == 2
        # through the router: concurrent requests, placed on the least loaded groups
        assert_cluster_matches(c, refs, SEED)
        # by hand: every pair of groups, then every request on the last group of each side
        spread = [(i % pd, (i // pd) % cd) for i in range(len(PROMPTS))]
        one = [(pd - 1, cd - 1)] * len(PROMPTS)
        for tag, pairs in (("spread", spread), ("one", one)):
            for i, r in enumerate(_direct(c, pairs, pd, cd, tag)):
                assert not r.error and r.token_ids == refs[False][i], \
                    (tag, i, pairs[i], r.error, r.token_ids, dump_logs(c))
                # a DP consumer names its group's rank only; a TP2 one both ranks
                want = [consumer_ranks[pairs[i][1]]] if cd > 1 else consumer_ranks
                assert split_addresses(r.kv_address) == want, (tag, i, r.kv_address)
        if pd == cd == 2:
            _bad_groups_are_refused_and_the_workers_serve_on(c, refs)
    finally:
        c.stop()


def _bad_groups_are_refused_and_the_workers_serve_on(c, refs: dict) -> None:
    status = {w.worker_id: w for w in c.status(30).workers}
    p, cons = status["worker-0"].address, status["worker-1"].address
    r = pd_request(p, cons, "worker-1", "bad-c", PROMPTS[0], GREEDY, 1, 0, 2)
    assert "dp_rank" in r.error and not r.token_ids, r
    r = pd_request(p, cons, "worker-1", "bad-p", PROMPTS[0], GREEDY, 1, 2, 0)
    assert "dp_rank" in r.error and not r.token_ids, r
    r = pd_request(p, cons, "worker-1", "after", PROMPTS[1], GREEDY, 1, 1, 0)
    assert not r.error and r.token_ids == refs[False][1], r
    ch, stub = stub_for(c.router_address)
    with ch:  # the refused requests hold nothing on either worker
        wait_for_full_kv(stub, timeout=30)


KILL_TOKENS = 200  # the longest prompt (50) + this stays within max_model_len 512
KILL_AT = 8  # tokens a worker-1 (consumer) request has streamed when its rank 1 is killed
HIT_DEADLINE_S = 30.0  # the death is acted on well before a collective's timeout (60 s)


def _on(stub, worker: str, min_tokens: int = 0) -> list:
    st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True),
                            timeout=30)
    return [r for r in st.requests if r.consumer == worker and (
        not min_tokens or r.state == "DECODING" and r.tokens_streamed >= min_tokens)]


def test_killing_one_groups_rank_takes_the_consumer_down_and_nothing_hangs(
        tmp_path_factory, model):
    path, _ = model
    c = start_cluster(tmp_path_factory, "dpa-kill", model=path, producers=1, consumers=2,
                      transfer_backend="ucx",
                      worker_args=(*ENGINE, "--tensor-parallel-size", "2",
                                   "--data-parallel-size", "2"))
    try:
        victim = [pid for pid in c.group_alive("worker-1")
                  if "engine.parallel.follower" in cmdline(pid)]
        assert len(victim) == 1, victim  # worker-1's rank 1: its group 1
        long = dict(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [f"dpa-kill-{i}" for i in range(len(PROMPTS))]
        ch, stub = stub_for(c.router_address)
        with ch, ThreadPoolExecutor(len(PROMPTS)) as pool:
            futs = [pool.submit(generate, stub, long, timeout=120, request_id=rid,
                                prompt_token_ids=router_pb2.TokenIds(ids=p))
                    for rid, p in zip(ids, PROMPTS, strict=True)]
            deadline = time.monotonic() + 60
            while not _on(stub, "worker-1", KILL_AT):
                if time.monotonic() > deadline or all(f.done() for f in futs):
                    pytest.fail("worker-1 never decoded a request\n" + dump_logs(c))
                time.sleep(0.02)
            os.kill(victim[0], signal.SIGKILL)
            t0 = time.monotonic()
            while _on(stub, "worker-1") and time.monotonic() - t0 < HIT_DEADLINE_S:
                time.sleep(0.05)
            assert not _on(stub, "worker-1"), dump_logs(c)
            results = [f.result(timeout=120) for f in futs]
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams

        with LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32") as llm:
            ref = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**long))]
        for rid, r, want in zip(ids, results, ref, strict=True):
            if r.error or r.code is not None:  # an error naming the worker whose rank died
                assert "worker-1" in f"{r.error} {r.details}", (rid, r.error, r.details)
            else:  # complete, with the same tokens, wherever it ended up
                assert r.token_ids == want, (rid, r.timing)
        deadline = time.monotonic() + 30
        while c.procs["worker-1"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.procs["worker-1"].poll() is not None, dump_logs(c)
        assert not c.group_alive("worker-1")  # its engine and both ranks too
        ch, stub = stub_for(c.router_address)
        with ch:
            r = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[0]))
            assert r.code is None and not r.error, (r.details, r.error, dump_logs(c))
            assert r.timing.consumer == "worker-2" and r.token_ids == ref[0][:10]
    finally:
        c.stop()
