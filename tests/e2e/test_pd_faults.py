"""A consumer whose KV port cannot be reached, on a live cluster: a real router,
producer and consumer, plus one more consumer that registers and reserves like a real one
but advertises a KV port nobody listens on. A request paired with it does not hang or take
others down: the producer's handshake fails, the router pairs the request again with the
real consumer (the tokens already streamed carried over), and the client gets the
colocated engine's tokens within its deadline."""

from __future__ import annotations

import ast
import os
import re
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from deploy.cluster import LocalCluster
from deploy.ports import free_port
from engine.sampling_params import SamplingParams

SAMPLING = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


class DeadKVConsumer(worker_pb2_grpc.WorkerServicer):
    """Registers as consumer-9 with the real consumer's identity; reserves blocks whose KV
    address is a closed port; holds each Decode stream open until the router ends it."""

    def __init__(self, ready: dict[str, Any], router: str) -> None:
        self.kv_address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
        self.ready, self.router = ready, router
        self.decodes: list[str] = []
        self.aborts: list[str] = []
        self.ended: list[str] = []
        self._stop = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Decode(self, request: Any, context: Any) -> Any:
        self.decodes.append(request.request_id)
        yield worker_pb2.DecodeOutput(reserved=worker_pb2.Reserved(
            kv_address=self.kv_address, block_ids=list(range(64))))
        while context.is_active() and not self._stop.is_set():
            time.sleep(0.05)
        self.ended.append(request.request_id)

    def Abort(self, request: Any, context: Any) -> Any:
        self.aborts.append(request.request_id)
        return worker_pb2.WorkerAbortResponse(ok=True)

    def _load(self) -> common_pb2.WorkerLoad:
        n = int(self.ready["kv_blocks_total"])
        return common_pb2.WorkerLoad(kv_blocks_free=n, kv_blocks_total=n)

    def _register(self, stub: worker_pb2_grpc.RegistryStub) -> None:
        stub.Register(worker_pb2.RegisterRequest(
            worker_id="consumer-9", role=common_pb2.ROLE_CONSUMER,
            address=f"127.0.0.1:{self.port}", kv_address=self.kv_address,
            model=self.ready["model"], kv_fingerprint=self.ready["kv_fingerprint"],
            max_model_len=int(self.ready["max_model_len"]), load=self._load()), timeout=10)

    def _heartbeat(self) -> None:
        with grpc.insecure_channel(self.router) as ch:
            stub = worker_pb2_grpc.RegistryStub(ch)
            while not self._stop.wait(0.5):
                try:
                    r = stub.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="consumer-9",
                                                                   load=self._load()),
                                       timeout=5)
                    if not r.known:
                        self._register(stub)
                except grpc.RpcError:
                    pass

    def start(self) -> None:
        self.server.start()
        with grpc.insecure_channel(self.router) as ch:
            self._register(worker_pb2_grpc.RegistryStub(ch))
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def stop(self) -> None:
        """Leaves as a drained worker does (Deregister done): the router forgets consumer-9
        at once, and the shared cluster is a plain 1P1D again for the tests after this."""
        self._stop.set()
        self.server.stop(0)
        self._beat.join(10)  # no heartbeat in flight registers it again after this
        with grpc.insecure_channel(self.router) as ch:
            router_pb2_grpc.MembershipStub(ch).Deregister(router_pb2.DeregisterRequest(
                worker_id="consumer-9", done=True, reason="test over"), timeout=10)


def _ready_info(cluster: LocalCluster, name: str) -> dict[str, Any]:
    assert cluster.log_dir
    with open(os.path.join(cluster.log_dir, f"{name}.log"), errors="replace") as f:
        m = re.search(r"engine ready: (\{.*\})\)", f.read())
    assert m is not None, dump_logs(cluster)
    info: dict[str, Any] = ast.literal_eval(m.group(1))
    return info


@pytest.fixture
def cluster(cluster_1p1d):  # type: ignore[no-untyped-def]
    """The session's 1P1D cluster (tests/e2e/conftest.py), whole again afterwards: the fake
    consumer leaves it, and this checks that it did."""
    yield cluster_1p1d
    workers = {w.worker_id for w in cluster_1p1d.status().workers}
    assert workers == {"worker-0", "worker-1"}, workers


def test_unreachable_consumer_kv_port_is_repaired_within_the_deadline(cluster,
                                                                      colocated_llm):
    fake = DeadKVConsumer(_ready_info(cluster, "worker-1"), cluster.router_address)
    fake.start()
    ch, stub = stub_for(cluster.router_address)
    try:
        tok = colocated_llm.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": f"Name a fruit ({i})."}])
                   for i in range(4)]
        refs = colocated_llm.generate(prompts, SamplingParams(**SAMPLING))
        t0 = time.monotonic()
        # round robin over worker-1 and consumer-9: half of these meet the dead port,
        # while the others run next to them
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(generate, stub, SAMPLING, timeout=120, request_id=f"dk{i}",
                                prompt_token_ids=router_pb2.TokenIds(ids=p))
                    for i, p in enumerate(prompts)]
            results = [f.result() for f in futs]
        took = time.monotonic() - t0
        assert fake.decodes, "no request was paired with the dead KV port"
        for r, ref in zip(results, refs, strict=True):
            assert r.code is None and r.error == "", (r.code, r.error, dump_logs(cluster))
            assert r.token_ids == ref.token_ids and r.text == ref.text
            assert r.timing.consumer == "worker-1"
        assert took < 100, took  # the handshake failure is bounded, nothing waits it out
        # each reservation on the dead-port consumer was given back (Abort / stream end)
        end = time.monotonic() + 10
        while set(fake.decodes) - set(fake.aborts) - set(fake.ended):
            assert time.monotonic() < end, (fake.decodes, fake.aborts, fake.ended)
            time.sleep(0.1)
        wait_for_full_kv(stub, timeout=60)  # the producer pinned nothing for it either
        assert all(w.healthy for w in cluster.status().workers)
    finally:
        ch.close()
        fake.stop()
