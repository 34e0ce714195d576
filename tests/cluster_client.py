"""A small synchronous client of the router's gRPC API, for end-to-end tests and scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    error: str = ""
    timing: Any = None
    usage: Any = None
    first_response_at: float = 0.0  # client monotonic time of the first message
    first_token_ids: list[int] = field(default_factory=list)  # what the first message carried
    messages: int = 0
    code: grpc.StatusCode | None = None  # set when the RPC itself failed
    details: str = ""


def chat(content: str) -> dict[str, Any]:
    return {"chat": router_pb2.ChatMessages(
        messages=[router_pb2.ChatMessage(role="user", content=content)])}


def generate(stub: router_pb2_grpc.RouterStub, sampling: dict[str, Any], timeout: float = 120,
             request_id: str = "", cancel_after: int | None = None, **inp: Any) -> Result:
    """Runs one Generate call; cancel_after=N cancels the stream after N messages."""
    req = router_pb2.GenerateRequest(request_id=request_id,
                                     sampling=common_pb2.SamplingParams(**sampling), **inp)
    res = Result()
    call = stub.Generate(req, timeout=timeout)
    try:
        for msg in call:
            if res.messages == 0:
                res.first_response_at = time.monotonic()
                res.first_token_ids = list(msg.token_ids)
            res.messages += 1
            res.token_ids += list(msg.token_ids)
            res.text += msg.text
            if msg.finish_reason:
                res.finish_reason = msg.finish_reason
                res.error = msg.error
                res.timing = msg.timing
                res.usage = msg.usage
            if cancel_after is not None and res.messages >= cancel_after:
                call.cancel()
                break
    except grpc.RpcError as e:
        res.code = e.code()
        res.details = e.details() or ""
    return res


def generate_all(address: str, prompts: list[list[int]],
                 sampling: Callable[[int], dict[str, Any]]) -> list[Result]:
    """Every prompt (by token ids) at once, prompt i with ``sampling(i)``; results in order."""
    ch, stub = stub_for(address)
    with ch, ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(generate, stub, sampling(i),
                            prompt_token_ids=router_pb2.TokenIds(ids=p))
                for i, p in enumerate(prompts)]
        return [f.result() for f in futs]


def stub_for(address: str) -> tuple[grpc.Channel, router_pb2_grpc.RouterStub]:
    ch = grpc.insecure_channel(address)
    return ch, router_pb2_grpc.RouterStub(ch)


def wait_for_full_kv(stub: router_pb2_grpc.RouterStub, timeout: float = 10.0) -> list[Any]:
    """Polls ClusterStatus until every worker reports all KV blocks free; returns workers."""
    end = time.monotonic() + timeout
    while True:
        workers = list(stub.ClusterStatus(router_pb2.ClusterStatusRequest()).workers)
        if workers and all(w.load.kv_blocks_free == w.load.kv_blocks_total > 0
                           and w.load.transfers_in_flight == 0 for w in workers):
            return workers
        if time.monotonic() > end:
            raise AssertionError(f"KV not back to full: {[(w.worker_id, w.load) for w in workers]}")
        time.sleep(0.25)


def wait_whole(cluster: Any, timeout: float = 45.0) -> None:
    """``wait_for_full_kv`` on a started cluster's router (its own channel)."""
    ch, s = stub_for(cluster.router_address)
    try:
        wait_for_full_kv(s, timeout)
    finally:
        ch.close()


FINISH = common_pb2
