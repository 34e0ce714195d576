"""Tensor-parallel producers and consumers in live clusters (router, gRPC workers, engine
processes and their follower ranks, real UCX / shared-memory transfers between each
producer rank and the consumer ranks that own its heads).

Tokens must equal the colocated TP1 engine's, greedy and seeded, for producer TP2 +
consumer TP1, TP1 + TP2 and TP2 + TP2, over ucx and ipc, with 2 KV heads (one per rank)
and 1 (replicated on both ranks of a TP2 worker). Six clusters cover that: each TP pair
runs on each backend, and each pair sees both head counts; a seventh runs producer TP2 +
consumer TP1 over nixl (a NIXL agent per rank on each side). Killing a follower rank of a TP
consumer mid-request ends its requests (error naming the worker, or migrated by the
router) and the cluster keeps serving on the other consumer; a producer rank dying while
its worker is idle takes the worker down too, and the other producer serves.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_client import generate, generate_all, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import router_pb2
from tiny_models import PROMPTS, make_tiny_model

from deploy.procs import cmdline
from engine.llm import LLM
from engine.sampling_params import SamplingParams

# block 4 and a 16-token budget: prompts are prefilled in several chunks, so each producer
# rank pushes runs while later chunks compute
ENGINE = ("--device", "cpu", "--dtype", "float32", "--block-size", "4",
          "--max-num-batched-tokens", "16", "--kv-cache-mib", "4")
# a longer prompt: 18 blocks, a run crossing many chunks
LONG = [(i * 37 + 11) % 250 + 3 for i in range(70)]
# ClusterStatus deadline: cluster.status's 2 s default timed out once on a loaded 2-core VM
STATUS_TIMEOUT_S = 30.0
CASES = [  # (backend, producer TP, consumer TP, KV heads)
    ("ucx", 2, 1, 2), ("ucx", 1, 2, 1), ("ucx", 2, 2, 2),
    ("ipc", 2, 1, 1), ("ipc", 1, 2, 2), ("ipc", 2, 2, 1),
    ("nixl", 2, 1, 2),
]


def _byte_tokenizer(path: str) -> None:
    """A 256-token byte-level tokenizer.json: the router needs one to serve the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(f"{path}/tokenizer.json")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("pdtp")
    out = {}
    for kv in (2, 1):
        path = make_tiny_model(os.path.join(root, f"kv{kv}"), "llama", seed=kv,
                               num_key_value_heads=kv)
        _byte_tokenizer(path)
        out[kv] = path
    return out


def _sampling(i: int, seeded: bool) -> dict:
    if seeded:
        return dict(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=500 + i,
                    ignore_eos=True)
    return dict(max_tokens=10, temperature=0.0, ignore_eos=True)


def _reference(path: str, prompts: list[list[int]], seeded: bool,
               **kw: object) -> list[list[int]]:
    params = [SamplingParams(**{**_sampling(i, seeded), **kw}) for i in range(len(prompts))]
    with LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32") as llm:
        return [c.token_ids for c in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tp1_tokens(models: dict[int, str]):  # type: ignore[no-untyped-def]
    """The colocated TP1 engine's tokens for [*PROMPTS, LONG], per (KV heads, seeded),
    computed once for the module: every case on the same model compares against them."""
    cache: dict[tuple[int, bool], list[list[int]]] = {}

    def get(kv: int, seeded: bool) -> list[list[int]]:
        if (kv, seeded) not in cache:
            cache[(kv, seeded)] = _reference(models[kv], [*PROMPTS, LONG], seeded)
        return cache[(kv, seeded)]

    return get


def _run(address: str, prompts: list[list[int]], seeded: bool) -> list:
    return generate_all(address, prompts, lambda i: _sampling(i, seeded))


def _cluster(tmp_path_factory, name: str, path: str, backend: str, ptp: int, ctp: int,
             consumers: int = 1):
    return start_cluster(tmp_path_factory, name, model=path, producers=1,
                         consumers=consumers, transfer_backend=backend,
                         worker_args=(*ENGINE, "--tensor-parallel-size", str(ctp)),
                         producer_args=("--tensor-parallel-size", str(ptp)))


@pytest.mark.parametrize("backend,ptp,ctp,kv", CASES,
                         ids=[f"{b}-p{p}c{c}-kv{k}" for b, p, c, k in CASES])
def test_tp_pair_tokens_equal_colocated_tp1(tmp_path_factory, models, tp1_tokens, backend, ptp,
                                            ctp, kv):
    path = models[kv]
    prompts = [*PROMPTS, LONG]
    refs = {s: tp1_tokens(kv, s) for s in (False, True)}
    c = _cluster(tmp_path_factory, f"tp-{backend}-{ptp}{ctp}", path, backend, ptp, ctp)
    try:
        status = {w.worker_id: w for w in c.status(STATUS_TIMEOUT_S).workers}
        assert status["worker-0"].tp_size == ptp and status["worker-1"].tp_size == ctp
        # a TP consumer advertises one KV address per rank
        assert len(status["worker-1"].kv_address.split(",")) == ctp
        for seeded in (False, True):
            results = _run(c.router_address, prompts, seeded)
            for i, r in enumerate(results):
                assert r.code is None and not r.error, (i, r.code, r.details, r.error,
                                                        dump_logs(c))
                assert r.timing.producer == "worker-0"
                assert r.timing.consumer == "worker-1"
                assert r.token_ids == refs[seeded][i], (seeded, i)
        ch, stub = stub_for(c.router_address)
        with ch:
            wait_for_full_kv(stub, timeout=30)  # every rank released its blocks
    finally:
        c.stop()


def _follower_ranks(c, name: str) -> list[int]:
    """Live follower-rank processes of worker ``name`` (they share its process group)."""
    return [pid for pid in c.group_alive(name) if "engine.parallel.follower" in cmdline(pid)]


KILL_TOKENS = 440  # the longest prompt (50) + this stays within max_model_len 512
# The kill lands once the router has streamed this many of a worker-1 request's tokens:
# a state the test observes, so the request is mid-decode whatever the machine's speed,
# with KILL_TOKENS - KILL_AT tokens still to go.
KILL_AT = 8
# How soon after the kill the router must have no request left on the dead worker: the
# step's collective fails at once (the peer's socket closes), the engine then waits up to
# 2 s to reap the rank; tp_timeout_s (60 s, the bound on a hung collective) must not be it.
HIT_DEADLINE_S = 30.0


def _on(stub, worker: str, min_tokens: int = 0) -> list:
    """The router's in-flight requests whose consumer is ``worker`` (DECODING, with at least
    ``min_tokens`` streamed, when min_tokens is set): the router's own view, not a
    heartbeat's."""
    st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True),
                            timeout=STATUS_TIMEOUT_S)
    return [r for r in st.requests if r.consumer == worker and (
        not min_tokens or r.state == "DECODING" and r.tokens_streamed >= min_tokens)]


def test_killing_a_consumer_rank_ends_its_requests_and_the_cluster_keeps_serving(
        tmp_path_factory, models):
    path = models[2]
    c = _cluster(tmp_path_factory, "tp-kill", path, "ucx", 1, 2, consumers=2)
    try:
        victim = _follower_ranks(c, "worker-1")
        assert len(victim) == 1, victim  # worker-1's rank 1
        ch, stub = stub_for(c.router_address)
        long = dict(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [f"tp-kill-{i}" for i in range(len(PROMPTS))]
        with ch, ThreadPoolExecutor(len(PROMPTS)) as pool:
            futs = [pool.submit(generate, stub, long, timeout=120, request_id=rid,
                                prompt_token_ids=router_pb2.TokenIds(ids=p))
                    for rid, p in zip(ids, PROMPTS, strict=True)]
            # round_robin puts two of the four on each consumer: kill worker-1's rank 1
            # once one of them has streamed KILL_AT tokens (a poll, then a kill: a few ms)
            deadline = time.monotonic() + 60
            while not (hit := _on(stub, "worker-1", KILL_AT)):
                if time.monotonic() > deadline or all(f.done() for f in futs):
                    pytest.fail("worker-1 never decoded a request\n" + dump_logs(c))
                time.sleep(0.02)
            os.kill(victim[0], signal.SIGKILL)
            t0 = time.monotonic()
            # the death is noticed and acted on: no request is left on worker-1 (each
            # ended with an error, or was placed again), well before a collective's timeout
            while (left := _on(stub, "worker-1")) and time.monotonic() - t0 < HIT_DEADLINE_S:
                time.sleep(0.05)
            off = time.monotonic() - t0
            assert not left, (off, left, dump_logs(c))
            results = [f.result(timeout=120) for f in futs]
            took = time.monotonic() - t0
            # shown with a failure (or -rP): where the kill landed, how long each part took
            print(f"TPKILL hit={[(r.request_id, r.tokens_streamed) for r in hit]} "
                  f"off={off:.2f}s took={took:.1f}s")
        ref = _reference(path, PROMPTS, False, max_tokens=KILL_TOKENS)
        with open(c.log_paths["router"], errors="replace") as f:
            migrated = {ln.split("request ", 1)[1].split(":", 1)[0] for ln in f
                        if "migrating after" in ln and "worker-1" in ln and "rank 1" in ln}
        failed = set()
        for rid, r, want in zip(ids, results, ref, strict=True):
            if r.error or r.code is not None:  # an error naming the worker whose rank died
                failed.add(rid)
                assert "worker-1" in f"{r.error} {r.details}", (rid, r.error, r.details)
            else:  # complete, with the same tokens, wherever it ended up
                assert r.token_ids == want, (rid, r.timing)
        # every request worker-1 was decoding at the kill was hit: failed, or migrated
        # with its streamed tokens (the router's log names the worker and the rank)
        for r in hit:
            assert r.request_id in failed | migrated, (r.request_id, failed, migrated,
                                                       dump_logs(c))
        assert took < 100, took  # generate's own timeout is 120 s
        # the worker as a whole went down (all its ranks), and the cluster serves on
        deadline = time.monotonic() + 30
        while c.procs["worker-1"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.procs["worker-1"].poll() is not None, dump_logs(c)
        assert not c.group_alive("worker-1")  # its engine and follower ranks too
        ch, stub = stub_for(c.router_address)
        with ch:
            r = generate(stub, dict(max_tokens=10, temperature=0.0, ignore_eos=True),
                         prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[0]))
            assert r.code is None and not r.error, (r.details, r.error, dump_logs(c))
            assert r.timing.consumer == "worker-2"
            assert r.token_ids == ref[0][:10]
            # once the router has dropped worker-1, the survivors hold no block of any
            # request that was on it (the producer's pushes to it included)
            deadline = time.monotonic() + 30
            while "worker-1" in {w.worker_id for w in c.status(STATUS_TIMEOUT_S).workers} \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert {w.worker_id for w in wait_for_full_kv(stub, timeout=30)} \
                == {"worker-0", "worker-2"}
    finally:
        c.stop()


def test_a_producer_rank_dying_while_idle_fails_its_worker_and_the_other_serves(
        tmp_path_factory, models, tp1_tokens):
    # No step is running, so no collective notices: rank 0's loop checks its followers on
    # every turn, and the worker must still go down as a whole, promptly.
    path = models[2]
    c = start_cluster(tmp_path_factory, "tp-pkill", model=path, producers=2, consumers=1,
                      worker_args=ENGINE, producer_args=("--tensor-parallel-size", "2"))
    try:
        victim = _follower_ranks(c, "worker-0")
        assert len(victim) == 1, victim
        os.kill(victim[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while c.procs["worker-0"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.procs["worker-0"].poll() is not None, dump_logs(c)
        with open(c.log_paths["worker-0"], errors="replace") as f:
            assert f"rank 1 (pid {victim[0]}) exited" in f.read()
        deadline = time.monotonic() + 30
        while "worker-0" in {w.worker_id for w in c.status(STATUS_TIMEOUT_S).workers} \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        ref = tp1_tokens(2, False)  # [*PROMPTS, LONG]: the first len(PROMPTS) are these
        results = _run(c.router_address, PROMPTS, False)
        for i, r in enumerate(results):
            assert r.code is None and not r.error, (i, r.details, r.error, dump_logs(c))
            assert r.timing.producer == "worker-1" and r.token_ids == ref[i], i
    finally:
        c.stop()
