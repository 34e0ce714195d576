"""Prefix caching across a live 2P2D cluster (real processes, gRPC, UCX, SmolLM2): the
workers' KV events reach the router's index; ``cache_aware`` sends requests sharing a
prefix to the workers holding it; only the blocks the consumer lacks cross the wire; a
consumer holding all but a short tail prefills it itself; a lying index moves a request but
never changes a token; every block comes back."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from engine.prefix_hash import block_hashes, chain_root
from engine.sampling_params import SamplingParams

TOKEN = "prefix-test-token"
BS = 16  # the workers' --block-size (default)
SYSTEM = ("You are a careful assistant for a logistics company. Answer in one short "
          "sentence, cite no sources, and never invent tracking numbers. ") * 3
# Each question longer than --local-prefill-max-tokens (24): these run P/D
DETAIL = (" I ordered it last week from the online shop, paid by card, and chose standard "
          "delivery to my home address in the city centre.")
QUESTIONS = [q + DETAIL for q in ("Where is my parcel?", "How do I change the address?",
                                  "Can I pick it up myself?", "What does 'in transit' mean?")]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTLE_S = 1.5  # the workers' load reports (their counters) go out every 0.5 s
INDEX_WAIT_S = 60.0  # for the router's index to show a worker's new blocks (a loaded host)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    # the HTTP door serves the router's /metrics (the index per worker)
    c = start_cluster(tmp_path_factory, "prefix2p2d", producers=2, consumers=2,
                      policy="cache_aware", cluster_token=TOKEN, http_port=0,
                      router_args=("--local-prefill-max-tokens", "24"),
                      worker_args=("--max-num-batched-tokens", "128", "--kv-cache-mib", "64"))
    yield c
    c.stop()


def _counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _received(cluster, name: str) -> float:  # type: ignore[no-untyped-def]
    """A consumer's received KV bytes, once its engine's next load report is out."""
    time.sleep(SETTLE_S)
    return _counter(cluster.metrics_ports[name], "pdserve_worker_kv_transfer_received_bytes_total")


def _router_view(cluster) -> dict[tuple[str, str], float]:  # type: ignore[no-untyped-def]
    """The router's per-worker gauges: (metric, worker id) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_worker_") and 'worker="' in line:
            labels, value = line.rsplit(" ", 1)
            name = labels.split("{", 1)[0]
            out[(name, labels.split('worker="', 1)[1].split('"', 1)[0])] = float(value)
    return out


def _indexed(cluster, worker_id: str) -> float:  # type: ignore[no-untyped-def]
    return _router_view(cluster).get(("pdserve_worker_kv_index_blocks", worker_id), 0.0)


IDLE = ("pdserve_worker_waiting", "pdserve_worker_running", "pdserve_worker_inflight",
        "pdserve_worker_transfers_in_flight")


def _wait_router_sees(cluster, worker_id: str, indexed: float) -> None:  # type: ignore[no-untyped-def]
    """Until the router's index holds ``indexed`` blocks of worker_id and its last report
    shows the worker idle: a cache-aware placement then weighs what the last request left
    there, not a stale load (a request's worth of load outweighs 512 cached tokens). A
    fixed 1.5 s sleep was too short once, on a loaded 2-core host: the next turn went to
    the other consumer, P/D."""
    end = time.monotonic() + INDEX_WAIT_S
    while True:
        view = _router_view(cluster)
        seen = view.get(("pdserve_worker_kv_index_blocks", worker_id), 0.0)
        busy = {m: view.get((m, worker_id)) for m in IDLE if view.get((m, worker_id), 0.0)}
        if seen >= indexed and not busy:
            return
        assert time.monotonic() < end, (worker_id, seen, indexed, busy, dump_logs(cluster))
        time.sleep(0.05)


def _ref(llm, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    return llm.generate([prompt], SamplingParams(**GREEDY))[0].token_ids


def _shared_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while (n + 1) * BS <= min(len(a), len(b)) and a[n * BS:(n + 1) * BS] == b[n * BS:(n + 1) * BS]:
        n += 1
    return n


def _wid(cluster, worker_id: str) -> str:  # type: ignore[no-untyped-def]
    """The cluster's process name (worker-2) of a registered worker id."""
    for name in cluster.metrics_ports:
        if worker_id.startswith(name) or name in worker_id:
            return name
    raise AssertionError(f"no process for {worker_id}")


def test_shared_prefix_follows_the_cache_and_only_the_tail_moves(cluster, colocated_llm):
    tok = colocated_llm.tokenizer
    system = tok.encode(SYSTEM)
    prompts = [system + tok.encode(" " + q) for q in QUESTIONS]
    ch, stub = stub_for(cluster.router_address)
    with ch:
        before = {w.worker_id: _indexed(cluster, w.worker_id) for w in
                  stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers}
        first = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=prompts[0]))
        assert first.error == "" and first.token_ids == _ref(colocated_llm, prompts[0])
        p0, c0 = first.timing.producer, first.timing.consumer
        assert p0 and c0
        for w in (p0, c0):  # both hold the system prompt, as the router sees it
            _wait_router_sees(cluster, w, before[w] + len(prompts[0]) // BS)
        cname = _wid(cluster, c0)
        blocks0 = -(-len(prompts[0]) // BS)
        # the first request moved every block: that gives the bytes of one block
        per_block = _received(cluster, cname) / blocks0
        assert per_block > 0, dump_logs(cluster)
        for p in prompts[1:]:
            before = _received(cluster, cname)
            r = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=p))
            assert r.error == "" and r.token_ids == _ref(colocated_llm, p)
            # placed by the cache: the workers that hold the system prompt
            assert (r.timing.producer, r.timing.consumer) == (p0, c0), r.timing
            shared = min(_shared_blocks(prompts[0], p), (len(p) - 1) // BS)
            assert shared >= len(system) // BS - 1
            assert r.usage.cached_tokens >= shared * BS  # the producer's own hit
            # bytes on the wire: the blocks the consumer lacked, exactly
            missing = -(-len(p) // BS) - shared
            assert _received(cluster, cname) - before == pytest.approx(missing * per_block)
        wait_for_full_kv(stub)


def test_a_short_tail_is_prefilled_on_the_consumer_holding_the_rest(cluster, colocated_llm):
    tok = colocated_llm.tokenizer
    # a conversation no worker has seen: its first turn runs P/D
    base = tok.encode("Plan a three-day walking trip through the hills north of the lake, "
                      "with one night in a mountain hut and one in the village inn, and "
                      "list what to pack for rain.")
    ch, stub = stub_for(cluster.router_address)
    with ch:
        before = {w.worker_id: _indexed(cluster, w.worker_id) for w in
                  stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers}
        r0 = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=base))
        assert r0.error == "" and r0.timing.consumer and r0.timing.producer
        c0 = r0.timing.consumer
        _wait_router_sees(cluster, c0, before[c0] + len(base) // BS)
        follow = base + r0.token_ids[:4]  # the next turn: a few tokens more
        r1 = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=follow))
        assert r1.error == "" and r1.token_ids == _ref(colocated_llm, follow)
        # no producer: the consumer that held the conversation prefilled its tail
        assert r1.timing.colocated == r0.timing.consumer and not r1.timing.producer
        assert r1.usage.cached_tokens >= (len(base) // BS) * BS - BS
        wait_for_full_kv(stub)


def test_a_lying_index_moves_a_request_but_never_changes_a_token(cluster, colocated_llm):
    tok = colocated_llm.tokenizer
    prompt = tok.encode("An entirely new conversation about lighthouses and their keepers, "
                        "told in the plainest words possible.")
    ch, stub = stub_for(cluster.router_address)
    with ch:
        workers = stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers
        producers = sorted(w.worker_id for w in workers if w.role == common_pb2.ROLE_PRODUCER)
        liar = producers[-1]
        fp = next(w.kv_fingerprint for w in workers if w.worker_id == liar)
        claim = block_hashes(prompt, BS, chain_root(fp))
        reg = worker_pb2_grpc.RegistryStub(ch)
        ack = reg.PublishKVEvents(worker_pb2.KVEventBatch(
            worker_id=liar, cluster_token=TOKEN, epoch=12345,
            snapshot=worker_pb2.KVCacheSnapshot(seq=1, block_hashes=claim)))
        assert ack.known and not ack.resync
        # junk is refused by field, and the router keeps serving
        with pytest.raises(grpc.RpcError) as e:
            reg.PublishKVEvents(worker_pb2.KVEventBatch(
                worker_id=liar, cluster_token=TOKEN, epoch=1,
                events=[worker_pb2.KVBlockEvent(seq=2, block_hashes=[b"x"])]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_hashes" in (e.value.details() or "")
        r = generate(stub, GREEDY, prompt_token_ids=router_pb2.TokenIds(ids=prompt))
        assert r.error == "" and r.timing.producer == liar  # the lie placed it...
        assert r.usage.cached_tokens == 0  # ...where nothing was cached: computed
        assert r.token_ids == _ref(colocated_llm, prompt)  # and the tokens are right
        wait_for_full_kv(stub)
