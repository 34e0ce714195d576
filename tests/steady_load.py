"""Steady load against a live cluster, for drain, rolling-restart and role-change tests: a
tiny model (so a CPU test can keep several requests in flight cheaply), a few client
threads each sending one request after another, and a check of every result against the
in-process colocated engine."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from cluster_client import Result, generate, stub_for
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tiny_models import make_tiny_model
from tokenizers import Tokenizer, models

from deploy.cluster import LocalCluster

VOCAB = 256  # tiny_models.TINY
# Prompts of mixed lengths: several span more than one 32-token prefill chunk.
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)]
           for i, n in enumerate((5, 11, 40, 75, 23, 130, 64, 9))]


def tiny_served_model(path: str, max_len: int = 4096) -> str:
    """A tiny llama with a word-level tokenizer of its 256 ids (the router needs one)."""
    make_tiny_model(path, "llama", max_position_embeddings=max_len)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.save(os.path.join(path, "tokenizer.json"))
    return path


def sampling(i: int, max_tokens: int) -> dict[str, Any]:
    """Greedy for even i, seeded for odd: both must match the colocated engine."""
    if i % 2:
        return dict(max_tokens=max_tokens, temperature=0.8, top_k=20, seed=100 + i,
                    ignore_eos=True)
    return dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Sent:
    prompt: int  # index into PROMPTS
    max_tokens: int
    result: Result


@dataclass
class SteadyLoad:
    """``clients`` threads, each sending one request after another until stopped."""

    address: str
    clients: int = 3
    max_tokens: tuple[int, ...] = (24, 48, 96)
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, k: int) -> None:
        ch, stub = stub_for(self.address)
        with ch:
            n = 0
            while not self._stop.is_set():
                p = (k * 5 + n) % len(PROMPTS)
                mt = self.max_tokens[(k + n) % len(self.max_tokens)]
                # the id names max_tokens: wait_decoding reads how much of it is left
                r = generate(stub, sampling(p, mt), timeout=300, request_id=f"load-{k}-{n}-{mt}",
                             prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[p]))
                with self._lock:
                    self.sent.append(Sent(p, mt, r))
                n += 1

    @contextmanager
    def running(self) -> Iterator[SteadyLoad]:
        with ThreadPoolExecutor(self.clients) as pool:
            futs: list[Future[None]] = [pool.submit(self._client, k)
                                        for k in range(self.clients)]
            try:
                yield self
            finally:
                self._stop.set()
                for f in futs:
                    f.result()

    def count(self) -> int:
        with self._lock:
            return len(self.sent)

    def wait_for(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` more requests have finished (the cluster is serving)."""
        target, end = self.count() + n, time.monotonic() + timeout
        while self.count() < target:
            assert time.monotonic() < end, f"load stalled at {self.count()} requests"
            time.sleep(0.1)


def check_against_colocated(sent: list[Sent], llm: Any) -> None:
    """Every request succeeded, and with the colocated engine's tokens.

    The engine runs each prompt once, to the longest max_tokens it was sent with: a request
    for fewer tokens must get exactly the first max_tokens of those (ignore_eos, so only the
    length stops it; greedy, or seeded sampling, whose randomness is a function of the seed
    and the position). One sequence per prompt instead of one per (prompt, max_tokens) is
    a third of the reference's batch: on a 2-core machine it took longer than the load."""
    from engine.sampling_params import SamplingParams

    bad = [(s.prompt, s.result.code, s.result.details, s.result.error) for s in sent
           if s.result.code is not None or s.result.error
           or s.result.finish_reason != common_pb2.FINISH_REASON_LENGTH]
    assert not bad, f"{len(bad)} of {len(sent)} requests failed: {bad[:5]}"
    longest: dict[int, int] = {}
    for s in sent:
        longest[s.prompt] = max(longest.get(s.prompt, 0), s.max_tokens)
    keys = sorted(longest.items())
    ref = llm.generate([PROMPTS[p] for p, _ in keys],
                       [SamplingParams(**sampling(p, mt)) for p, mt in keys])
    want = {p: c.token_ids for (p, _), c in zip(keys, ref, strict=True)}
    for s in sent:
        assert len(want[s.prompt]) == longest[s.prompt]
        assert len(s.result.token_ids) == s.max_tokens
        assert s.result.token_ids == want[s.prompt][:s.max_tokens], (s.prompt, s.max_tokens)


def workers(c: LocalCluster) -> dict[str, router_pb2.WorkerStatus]:
    return {w.worker_id: w for w in c.status(timeout=10).workers}


def wait_until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def requests_on(c: LocalCluster, names: tuple[str, ...]) -> list[list[router_pb2.RequestStatus]]:
    """For each of ``names``, the router's in-flight requests decoding there (as consumer,
    or as the colocated worker serving them whole), from one look at its own view."""
    with grpc.insecure_channel(c.router_address) as ch:
        st = router_pb2_grpc.RouterStub(ch).ClusterStatus(
            router_pb2.ClusterStatusRequest(include_requests=True), timeout=10,
            metadata=c.auth_metadata())
    return [[r for r in st.requests if name in (r.consumer, r.colocated)] for name in names]


def tokens_left(r: router_pb2.RequestStatus) -> int:
    """Tokens a SteadyLoad request has still to stream (its id names its max_tokens)."""
    return int(r.request_id.rsplit("-", 1)[1]) - r.tokens_streamed


def wait_decoding(c: LocalCluster, names: str | tuple[str, ...], left: int,
                  timeout: float = 120.0) -> None:
    """Until the router shows, on each of ``names`` at once, a SteadyLoad request decoding
    with at least ``left`` tokens still to stream, so that a drain or role change started now
    has work in flight whatever the machine's speed. (A heartbeat's load count is up to an
    interval old, and the request it saw may have streamed its last token since: CI once saw
    four drains in a row find nothing in flight.)"""
    names = (names,) if isinstance(names, str) else names

    def holds(rs: list[router_pb2.RequestStatus]) -> bool:
        return any(r.state == "DECODING" and r.request_id.startswith("load-")
                   and tokens_left(r) >= left for r in rs)

    wait_until(lambda: all(holds(rs) for rs in requests_on(c, names)), timeout,
               f"{', '.join(names)} each decoding a request with {left}+ tokens to go")


def log_text(c: LocalCluster, name: str) -> str:
    with open(c.log_paths[name], errors="replace") as f:
        return f.read()
