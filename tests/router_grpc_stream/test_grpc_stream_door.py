"""The router's hand-framed gRPC door (``--grpc-stream-port``) against a live 1P1D cluster
(tiny dummy model, real processes) and a real grpcio client: the same tokens, text, finish
reasons and usage as the grpc.aio door for the same requests; the same refusals; a client's
cancel and a deadline abort the request on the workers; a slow reader's tokens wait for its
window and leave merged; junk bytes, a bad preface, a malformed frame or an oversized
message close that connection only; shutdown ends the open streams with their final
message. The shutdown test stops the router: it runs last."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import h2.events
import pytest
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router_grpc_stream.h2_client import RawH2, ended, frame_types, messages, trailers

from deploy.benchmark.dummy_model import write_dummy_model
from deploy.cluster import LocalCluster
from deploy.ports import free_port

KEY = "door-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
WORKER_ARGS = ("--load-format", "dummy", "--max-num-batched-tokens", "128",
               "--kv-cache-mib", "32")
MAX_RUNNING, MAX_QUEUED = 4, 4
PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 40, 130, 17))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    model = write_dummy_model(str(tmp_path_factory.mktemp("h2door-model")), "tiny")
    port = free_port()
    c = start_cluster(tmp_path_factory, "h2door", model=model, worker_args=WORKER_ARGS,
                      api_key=KEY,
                      router_args=("--grpc-stream-port", str(port),
                                   "--max-running-requests", str(MAX_RUNNING),
                                   "--max-queued-requests", str(MAX_QUEUED)))
    c.stream_port = port  # type: ignore[attr-defined]
    with grpc.insecure_channel(c.router_address) as ch:
        models = router_pb2_grpc.RouterStub(ch).ListModels(router_pb2.ListModelsRequest(),
                                                           metadata=AUTH, timeout=10)
    c.max_len = models.models[0].max_model_len  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.stop()


def _stream_address(c: LocalCluster) -> str:
    return f"127.0.0.1:{c.stream_port}"  # type: ignore[attr-defined]


class Call:
    """One Generate call's outcome, read with a real grpcio client."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.messages = 0
        self.last: router_pb2.GenerateResponse | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailers: dict[str, str] = {}


def _generate(address: str, sampling: dict[str, Any], *, metadata: Any = AUTH,
              timeout: float = 60, cancel_after: int | None = None,
              options: Any = (), compression: Any = None, **inp: Any) -> Call:
    if "prompt_token_ids" in inp:
        inp["prompt_token_ids"] = router_pb2.TokenIds(ids=inp["prompt_token_ids"])
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **inp)
    out = Call()
    with grpc.insecure_channel(address, options=options, compression=compression) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(req, timeout=timeout, metadata=metadata)
        try:
            for msg in call:
                out.messages += 1
                out.token_ids += msg.token_ids
                out.text += msg.text
                out.last = msg
                if cancel_after is not None and out.messages >= cancel_after:
                    call.cancel()
                    break
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
            out.trailers = dict(e.trailing_metadata() or ())
    return out


def _both(c: LocalCluster, sampling: dict[str, Any], **inp: Any) -> tuple[Call, Call]:
    return (_generate(c.router_address, sampling, **inp),
            _generate(_stream_address(c), sampling, **inp))


def _quiet(c: LocalCluster, timeout: float = 15.0) -> None:
    """Waits for no request on the router and none running or waiting on any worker."""
    ch = grpc.insecure_channel(c.router_address)
    stub = router_pb2_grpc.RouterStub(ch)
    end = time.monotonic() + timeout
    try:
        while True:
            st = stub.ClusterStatus(router_pb2.ClusterStatusRequest(include_requests=True),
                                    metadata=AUTH, timeout=5)
            busy = [(w.worker_id, w.load.running, w.load.waiting) for w in st.workers
                    if w.load.running or w.load.waiting]
            if not st.requests and not busy:
                return
            if time.monotonic() > end:
                raise AssertionError(f"still in flight: {list(st.requests)} {busy}\n"
                                     + dump_logs(c))
            time.sleep(0.2)
    finally:
        ch.close()


def _long(c: LocalCluster, prompt: list[int]) -> int:
    """A max_tokens that runs to the context's end: longer than any test waits."""
    return c.max_len - len(prompt)  # type: ignore[attr-defined]


def _same(a: Call, b: Call) -> None:
    assert a.code is None and b.code is None, (a.code, a.details, b.code, b.details)
    assert a.last is not None and b.last is not None
    assert b.token_ids == a.token_ids
    assert b.text == a.text
    assert b.last.finish_reason == a.last.finish_reason != 0
    assert b.last.error == a.last.error == ""
    assert b.last.usage.prompt_tokens == a.last.usage.prompt_tokens > 0
    assert b.last.usage.completion_tokens == a.last.usage.completion_tokens == len(a.token_ids)


def test_same_tokens_as_the_grpc_aio_door(cluster: LocalCluster) -> None:
    results: dict[tuple[int, bool], tuple[Call, Call]] = {}

    def one(i: int, seeded: bool) -> None:
        sampling: dict[str, Any] = (dict(max_tokens=24, temperature=0.9, top_p=0.95,
                                         seed=1000 + i) if seeded
                                    else dict(max_tokens=24, temperature=0.0))
        results[i, seeded] = _both(cluster, sampling, prompt_token_ids=PROMPTS[i])

    threads = [threading.Thread(target=one, args=(i, s)) for i in range(len(PROMPTS))
               for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (i, seeded), (aio, door) in sorted(results.items()):
        _same(aio, door)
        assert len(door.token_ids) == 24, (i, seeded)
    # a stop token: a STOP finish, cut where the grpc.aio door cuts; a text prompt
    stop_at = results[3, False][1].token_ids[5]
    aio, door = _both(cluster, dict(max_tokens=24, temperature=0.0,
                                    stop_token_ids=[stop_at]), prompt_token_ids=PROMPTS[3])
    assert door.last is not None and door.last.finish_reason == common_pb2.FINISH_REASON_STOP
    _same(aio, door)
    aio, door = _both(cluster, dict(max_tokens=8, temperature=0.0), prompt="hello there")
    _same(aio, door)


def test_refusals_match_the_grpc_aio_door(cluster: LocalCluster) -> None:
    bad = dict(max_tokens=8, temperature=-1.0)
    aio, door = _both(cluster, bad, prompt_token_ids=PROMPTS[0])
    assert door.code == aio.code == grpc.StatusCode.INVALID_ARGUMENT
    assert door.details == aio.details and "temperature" in door.details
    for md in ((), (("authorization", "Bearer wrong"),)):
        aio, door = _both(cluster, dict(max_tokens=4), metadata=md,
                          prompt_token_ids=PROMPTS[0])
        assert door.code == aio.code == grpc.StatusCode.UNAUTHENTICATED
        assert door.details == aio.details
    # a message that is not what its prefix says, and compression: refused, not served
    door = _generate(_stream_address(cluster), dict(max_tokens=4),
                     compression=grpc.Compression.Gzip, prompt_token_ids=PROMPTS[0])
    assert door.code == grpc.StatusCode.UNIMPLEMENTED, (door.code, door.details)
    assert "grpc-encoding" in door.details
    # every other method stays on the main port
    with grpc.insecure_channel(_stream_address(cluster)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            router_pb2_grpc.RouterStub(ch).ListModels(router_pb2.ListModelsRequest(),
                                                      metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "ListModels" in (e.value.details() or "")


def test_busy_is_resource_exhausted_and_cancel_aborts_on_the_worker(
        cluster: LocalCluster) -> None:
    """Running and queue slots full: the next request is refused with the retry hint; the
    held requests, cancelled mid-stream by their clients, leave nothing on the workers."""
    stop = threading.Event()
    started = threading.Semaphore(0)
    held: list[Call] = []

    def hold(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        req = router_pb2.GenerateRequest(
            prompt_token_ids=router_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=_long(cluster, prompt),
                                               ignore_eos=True))
        with grpc.insecure_channel(_stream_address(cluster)) as ch:
            call = router_pb2_grpc.RouterStub(ch).Generate(req, timeout=120, metadata=AUTH)
            out = Call()
            held.append(out)
            signalled = False
            try:
                for msg in call:
                    out.messages += 1
                    out.token_ids += msg.token_ids
                    if not signalled:
                        signalled = True
                        started.release()
                    if stop.is_set():
                        call.cancel()
                        break
            except grpc.RpcError as e:
                out.code = e.code()
        if not signalled:
            started.release()

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(MAX_RUNNING)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert started.acquire(timeout=60)
        queued = [threading.Thread(target=hold, args=(i,)) for i in range(MAX_QUEUED)]
        for t in queued:
            t.start()
        threads += queued
        time.sleep(1.0)  # the queued ones take their queue slots
        aio, door = _both(cluster, dict(max_tokens=4), prompt_token_ids=PROMPTS[0])
        assert door.code == aio.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (door.code,
                                                                            door.details)
        assert door.details == aio.details
        assert door.trailers.get("retry-after") == aio.trailers.get("retry-after") == "1"
        assert door.trailers.get("grpc-retry-pushback-ms") == "1000"
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert all(len(h.token_ids) > 0 for h in held[:MAX_RUNNING])
    _quiet(cluster)


def test_deadline_exceeded_aborts_on_the_worker(cluster: LocalCluster) -> None:
    t0 = time.monotonic()
    door = _generate(_stream_address(cluster),
                     dict(max_tokens=_long(cluster, PROMPTS[1]), ignore_eos=True),
                     timeout=1.5, prompt_token_ids=PROMPTS[1])
    assert door.code == grpc.StatusCode.DEADLINE_EXCEEDED, (door.code, door.details)
    assert door.messages > 0  # it was streaming when the deadline passed
    assert time.monotonic() - t0 < 10
    _quiet(cluster)


def _behind_a_shut_window(cluster: LocalCluster, sampling: dict[str, Any],
                          prompt: list[int]) -> tuple[Any, int]:
    """A raw HTTP/2 client's Generate stream whose window holds one small message, read up
    to its first DATA without acknowledging it: the window stays shut. The caller closes
    the client."""
    req = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=prompt),
                                     sampling=common_pb2.SamplingParams(**sampling))
    body = req.SerializeToString()
    raw = RawH2(cluster.stream_port, window=40, key=KEY)  # type: ignore[attr-defined]
    try:
        sid = raw.start(b"\x00" + len(body).to_bytes(4, "big") + body)
        raw.read(lambda evs: any(isinstance(e, h2.events.DataReceived) for e in evs),
                 ack=False)
    except BaseException:
        raw.close()
        raise
    return raw, sid


def test_slow_reader_gets_every_token_merged(cluster: LocalCluster) -> None:
    """A reader whose stream window holds one small message: its tokens wait (flow
    control) and leave merged once it opens the window; they are the grpc.aio door's."""
    sampling = dict(max_tokens=48, temperature=0.8, seed=77, ignore_eos=True)
    aio = _generate(cluster.router_address, sampling, prompt_token_ids=PROMPTS[2])
    raw, sid = _behind_a_shut_window(cluster, sampling, PROMPTS[2])
    try:
        time.sleep(2.0)  # the window stays shut while the request decodes
        for e in raw.events:  # now open it: what came so far is read
            if isinstance(e, h2.events.DataReceived):
                raw.h2.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
        raw.send()
        evs = raw.read(ended(sid))
    finally:
        raw.close()
    msgs, frames = messages(evs, sid)
    assert trailers(evs, sid).get("grpc-status") == "0", evs[-5:]
    resps = [router_pb2.GenerateResponse.FromString(m) for m in msgs]
    assert [t for r in resps for t in r.token_ids] == aio.token_ids
    assert "".join(r.text for r in resps) == aio.text
    assert resps[-1].usage.completion_tokens == 48
    assert len(resps) < 48 // 2, len(resps)  # the held tokens left merged
    assert frames > len(resps)  # messages past the window went out in pieces


def test_a_merged_message_leaves_split_at_the_max_frame_size(cluster: LocalCluster) -> None:
    """Tokens with 20 logprob alternatives each, held behind a shut window, merge into a
    message past the client's 16 KiB MAX_FRAME_SIZE; a large WINDOW_UPDATE lets it out in
    frames of at most that size, and it reads back as the grpc.aio door's tokens."""
    sampling = dict(max_tokens=96, temperature=0.0, logprobs=20, ignore_eos=True)
    aio = _generate(cluster.router_address, sampling, prompt_token_ids=PROMPTS[1])
    raw, sid = _behind_a_shut_window(cluster, sampling, PROMPTS[1])
    try:
        time.sleep(2.5)  # the request decodes to its end behind the shut window
        raw.h2.increment_flow_control_window(1 << 22, sid)
        raw.h2.increment_flow_control_window(1 << 22)
        raw.send()
        evs = raw.read(ended(sid))
    finally:
        raw.close()
    assert trailers(evs, sid).get("grpc-status") == "0", evs[-5:]
    sizes = [len(e.data) for e in evs if isinstance(e, h2.events.DataReceived)]
    assert max(sizes) == 16384, sizes  # split at the client's MAX_FRAME_SIZE
    msgs, _ = messages(evs, sid)
    resps = [router_pb2.GenerateResponse.FromString(m) for m in msgs]
    assert max(len(m) for m in msgs) > 16384
    assert [t for r in resps for t in r.token_ids] == aio.token_ids
    assert len(aio.token_ids) == 96


def _closed_only_that(cluster: LocalCluster, data: bytes, preface: bool) -> bytes:
    s = socket.create_connection(("127.0.0.1", cluster.stream_port), timeout=10)  # type: ignore[attr-defined]
    got = b""
    try:
        if preface:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        s.sendall(data)
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
    return got


def test_junk_and_malformed_frames_close_that_connection_only(cluster: LocalCluster) -> None:
    # junk instead of the preface; then a bad preface; then a DATA frame on stream 0
    for data, preface in ((os.urandom(512), False), (b"GET / HTTP/1.1\r\n\r\n", False),
                          (b"\x00\x00\x04\x00\x00\x00\x00\x00\x00abcd", True)):
        got = _closed_only_that(cluster, data, preface)  # returns: the server closed it
        # its SETTINGS (type 4) first, then GOAWAY (type 7) saying why, then the close
        assert frame_types(got)[0] == 4 and frame_types(got)[-1] == 7, got
    # an oversized message, declared in its prefix: refused before its bytes come
    raw = RawH2(cluster.stream_port, key=KEY)  # type: ignore[attr-defined]
    try:
        sid = raw.start(b"\x00" + (65 << 20).to_bytes(4, "big") + b"\x00" * 64)
        evs = raw.read(ended(sid))
    finally:
        raw.close()
    t = trailers(evs, sid)
    assert t.get("grpc-status") == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), evs
    assert "larger than max" in t.get("grpc-message", "")
    # the router still serves both doors
    _same(*_both(cluster, dict(max_tokens=6, temperature=0.0), prompt_token_ids=PROMPTS[3]))


def test_shutdown_ends_open_streams_with_their_final_message(cluster: LocalCluster) -> None:
    """Last: stops the router. A stream open at SIGTERM gets GOAWAY, then its final message
    (the run ended by the shutdown) and OK trailers, not a cut connection."""
    out: dict[str, Call] = {}
    first = threading.Event()

    def long() -> None:
        req = router_pb2.GenerateRequest(
            prompt_token_ids=router_pb2.TokenIds(ids=PROMPTS[0]),
            sampling=common_pb2.SamplingParams(max_tokens=_long(cluster, PROMPTS[0]),
                                               ignore_eos=True))
        c = Call()
        with grpc.insecure_channel(_stream_address(cluster)) as ch:
            try:
                for msg in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60,
                                                                    metadata=AUTH):
                    c.messages += 1
                    c.last = msg
                    first.set()
            except grpc.RpcError as e:
                c.code, c.details = e.code(), e.details() or ""
        out["c"] = c
        first.set()

    t = threading.Thread(target=long)
    t.start()
    assert first.wait(60)
    os.killpg(cluster.procs["router"].pid, signal.SIGTERM)
    t.join(30)
    c = out["c"]
    assert c.code is None, (c.code, c.details)
    assert c.last is not None and c.messages > 1
    assert c.last.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "shutting down" in c.last.error
    assert cluster.procs["router"].wait(20) == 0
