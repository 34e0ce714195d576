"""A plain Outputs stream's life (worker/outputs_port.py read by
router/requests/outputs_plain.py, both real, over real sockets, each case over both
listeners: TCP and the abstract Unix socket): the batches arrive as the hub queued them and a
router that leaves hands its requests back; a failed hub ends the stream with UNAVAILABLE
after what was queued, a failed engine refuses new streams; a router that does not read gets
the steps merged, losslessly; a stop writes what was queued before ending the streams; a
step leaves inside the flush that queued it."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from outputs_port_helpers import (
    _LEN,
    TOKEN,
    TRANSPORTS,
    Port,
    call,
    run_async,
    wait_until,
)
from pdserve.v1 import worker_pb2

import worker.outputs_port as op
from router.requests.outputs_plain import PlainOutputsEnded


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_batches_arrive_in_order_and_a_router_that_leaves_hands_its_requests_back(
        transport: str) -> None:
    async with Port() as p:
        c = call(**p.where(transport))
        it = c.__aiter__()
        first = await anext(it)
        assert first.seq == 0 and not first.tokens  # subscribed
        assert c.transport == transport
        sub = p.hub.subscribers["router-1"]
        for rid in ("a", "b", "c"):
            p.hub.attach(rid, sub)
        p.step(["a", "b", "c"], 100)
        p.step(["a", "b"], 200)
        got = []
        while len(got) < 5:
            batch = await anext(it)
            got += [(t.request_id, list(t.token_ids), t.text) for t in batch.tokens]
        assert got == [("a", [100], " t100"), ("b", [101], " t101"), ("c", [102], " t102"),
                       ("a", [200], " t200"), ("b", [201], " t201")]
        c.cancel()
        await it.aclose()
        # the worker sees the close and aborts what the router left running
        await wait_until(lambda: len(p.orphans) == 3)
        assert sorted(p.orphans) == ["a", "b", "c"]
        assert "router-1" not in p.hub.subscribers


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_failed_hub_ends_the_stream_with_unavailable(transport: str) -> None:
    async with Port() as p:
        it = call(**p.where(transport)).__aiter__()
        await anext(it)
        sub = p.hub.subscribers["router-1"]
        p.hub.attach("a", sub)
        p.step(["a"], 5)
        p.hub.fail("engine process exited")
        batch = await anext(it)  # what was queued before the failure still comes
        assert [t.request_id for t in batch.tokens] == ["a"]
        with pytest.raises(PlainOutputsEnded) as e:
            await anext(it)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "engine process exited" in str(e.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_failed_engine_refuses_new_streams(transport: str) -> None:
    async with Port() as p:
        p.fatal = "engine process exited"
        with pytest.raises(PlainOutputsEnded) as e:
            await anext(call(**p.where(transport)).__aiter__())
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_router_that_does_not_read_gets_the_steps_merged_losslessly(
        monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """With the socket full, the worker's write waits and the hub merges the steps that come
    meanwhile into the next batch: fewer frames than steps, every token in order."""
    monkeypatch.setattr(op, "HIGH_WATER", 1024)
    async with Port() as p:
        s = p.raw_socket(transport)
        hello = worker_pb2.OutputsRequest(subscriber_id="slow", cluster_token=TOKEN)
        s.sendall(_LEN.pack(hello.ByteSize()) + hello.SerializeToString())
        await wait_until(lambda: "slow" in p.hub.subscribers)
        sub = p.hub.subscribers["slow"]
        rids = [f"r{i:03d}" for i in range(64)]
        for rid in rids:
            p.hub.attach(rid, sub)
        steps = 200
        for k in range(steps):  # ~13 MB of batches: past what the sockets' buffers take
            p.step(rids, 1000 * k, pad=1000)
            await asyncio.sleep(0)
        s.setblocking(False)
        loop = asyncio.get_running_loop()
        buf = b""
        frames: list[worker_pb2.OutputsFrame] = []
        want = steps * len(rids)
        while sum(len(f.batch.tokens) for f in frames) < want:
            buf += await asyncio.wait_for(loop.sock_recv(s, 1 << 16), 10)
            while len(buf) >= 4 and len(buf) >= 4 + _LEN.unpack(buf[:4])[0]:
                (n,) = _LEN.unpack(buf[:4])
                frames.append(worker_pb2.OutputsFrame.FromString(buf[4:4 + n]))
                buf = buf[4 + n:]
        s.close()
        tokens = [(t.request_id, t.token_ids[0]) for f in frames for t in f.batch.tokens]
        assert tokens == [(rid, 1000 * k + i) for k in range(steps)
                          for i, rid in enumerate(rids)]
        assert len(frames) - 1 < steps  # merged: the first frame is the empty one


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_stop_writes_what_was_queued_before_ending_the_streams(transport: str) -> None:
    """A drained worker's last tokens are queued just before it stops: they still go out."""
    p = Port()
    await p.__aenter__()
    it = call(**p.where(transport)).__aiter__()
    await anext(it)
    sub = p.hub.subscribers["router-1"]
    p.hub.attach("a", sub)
    p.step(["a"], 9, finish="length")
    await p.port.stop()  # no yield between the step and the stop
    batch = await anext(it)
    assert [(t.request_id, list(t.token_ids)) for t in batch.tokens] == [("a", [9])]
    with pytest.raises(PlainOutputsEnded) as e:
        await anext(it)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def _recv_frame(s: socket.socket) -> worker_pb2.OutputsFrame:
    """One frame off a blocking socket (its timeout bounds the wait)."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            assert chunk, "the worker closed the connection"
            data += chunk
        return data
    (n,) = _LEN.unpack(exactly(4))
    return worker_pb2.OutputsFrame.FromString(exactly(n))


@pytest.mark.parametrize("transport", TRANSPORTS)
@run_async
async def test_a_step_leaves_inside_the_flush_that_queued_it(transport: str) -> None:
    """The stream's task is parked: the hub's flush writes the step's batch to the socket
    itself, so the router can read it before this process's loop runs again (no task
    wake-up per step). A blocking read right after the flush, with no await in between,
    finds it; with the batch left for the task, it would time out."""
    async with Port() as p:
        s = p.raw_socket(transport)
        hello = worker_pb2.OutputsRequest(subscriber_id="router-1",
                                          cluster_token=TOKEN).SerializeToString()
        s.sendall(_LEN.pack(len(hello)) + hello)
        await wait_until(lambda: "router-1" in p.hub.subscribers)
        s.settimeout(5)
        assert _recv_frame(s).batch.seq == 0  # subscribed
        await asyncio.sleep(0.05)  # the stream's task parks, waiting for a step
        p.hub.attach("a", p.hub.subscribers["router-1"])
        p.step(["a"], 7)  # the engine's message for one step, then the hub's flush
        s.settimeout(0.5)
        frame = _recv_frame(s)  # no await since the flush: the loop has not run
        assert frame.batch.seq == 1
        assert [(t.request_id, list(t.token_ids)) for t in frame.batch.tokens] == [("a", [7])]
        s.close()
