"""The gRPC process's per-step batching of outputs (reservations, tokens, ends) for
routers' Outputs streams."""

from __future__ import annotations

import asyncio

import pytest
from pdserve.v1 import common_pb2, worker_pb2

from engine.request import LogprobRow
from worker.messages import ReservedEvent, Token0Event, TransferResultEvent
from worker.output_hub import OutputHub, OutputsDone, SubscriberFailed
from worker.token_batch import TokensEvent


def tok(rid: str, ids: tuple[int, ...], finish: str | None = None) -> TokensEvent:
    return TokensEvent(rid, ids, "".join(chr(97 + i % 26) for i in ids), (), finish)


def test_one_batch_per_step_per_subscriber_and_done_names_its_seq() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        b, _ = hub.subscribe("router-b")
        for rid in ("r1", "r2"):
            hub.attach(rid, a)
        hub.attach("r3", b)
        # step 1: three requests, two routers -> two batches
        for ev in (tok("r1", (1,)), tok("r2", (2,)), tok("r3", (3,))):
            assert hub.add(ev)
        assert not hub.add(tok("inline", (9,)))  # no subscriber: its Decode carries it
        assert hub.flush() == []
        # step 2: r1 finishes
        hub.add(tok("r1", (4,), "length"))
        hub.add(tok("r2", (5,)))
        assert hub.flush() == [OutputsDone("r1", 2, "length")]
        assert not hub.owns("r1") and hub.owns("r2")
        assert hub.batches == 3 and hub.tokens == 5
        # a reader that lagged gets both of a's batches in one message, in order
        batch = await a.next_batch()
        assert batch.seq == 2
        assert [(t.request_id, list(t.token_ids)) for t in batch.tokens] == [
            ("r1", [1]), ("r2", [2]), ("r1", [4]), ("r2", [5])]
        assert batch.tokens[2].finish_reason == common_pb2.FINISH_REASON_LENGTH
        batch = await b.next_batch()
        assert (batch.seq, [t.request_id for t in batch.tokens]) == (1, ["r3"])
        # nothing queued: the reader waits for the next step
        waiter = asyncio.ensure_future(b.next_batch())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        hub.add(tok("r3", (6,)))
        hub.flush()
        assert (await waiter).seq == 2

    asyncio.run(main())


def test_a_subscriber_that_leaves_hands_back_its_requests() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        hub.attach("r1", a)
        hub.attach("r2", a)
        hub.add(tok("r2", (1,), "stop"))
        hub.flush()
        # replaced by a new stream under the same id: the old one's requests are orphans
        a2, orphans = hub.subscribe("router-a")
        assert orphans == ["r1"] and a.closed and not a2.closed
        assert not hub.add(tok("r1", (2,)))  # no longer routed anywhere
        hub.attach("r3", a2)
        assert hub.unsubscribe(a2) == ["r3"]
        assert hub.unsubscribe(a2) == []  # idempotent
        assert await hub.wait_for("router-a", 0.05) is None

    asyncio.run(main())


def test_a_reservation_leaves_in_the_batch_before_its_tokens() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        hub.attach("r1", a)
        assert hub.add_reserved(ReservedEvent("r1", "kv:1", (7, 8, 9), 1))
        assert not hub.add_reserved(ReservedEvent("other", "kv:1", (1,)))  # not attached
        hub.flush()
        hub.add(tok("r1", (5,)))
        hub.flush()
        batch = await a.next_batch()  # both batches, merged in order
        assert batch.seq == 2
        [r] = batch.reserved
        assert (r.request_id, r.kv_address, list(r.block_ids), r.cached_blocks) == (
            "r1", "kv:1", [7, 8, 9], 1)
        assert [(t.request_id, list(t.token_ids)) for t in batch.tokens] == [("r1", [5])]

    asyncio.run(main())


def test_a_failed_hub_sends_what_it_queued_then_ends_every_stream() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        b, _ = hub.subscribe("router-b")
        hub.attach("r1", a)
        hub.attach("r2", b)
        assert hub.running == 2
        hub.add(tok("r1", (1,)))  # said before the engine failed, not yet flushed
        waiter = asyncio.ensure_future(b.next_batch())
        await asyncio.sleep(0.01)
        hub.fail("engine process failed: boom")
        assert hub.running == 0 and not hub.owns("r1")
        assert [t.request_id for t in (await a.next_batch()).tokens] == ["r1"]
        with pytest.raises(SubscriberFailed, match="engine process failed: boom"):
            await a.next_batch()
        with pytest.raises(SubscriberFailed, match="boom"):
            await waiter

    asyncio.run(main())


def test_decode_may_wait_for_its_subscriber_to_open() -> None:
    async def main() -> None:
        hub = OutputHub()
        waiting = asyncio.ensure_future(hub.wait_for("late", 2.0))
        await asyncio.sleep(0.01)
        sub, _ = hub.subscribe("late")
        assert await waiting is sub

    asyncio.run(main())


@pytest.mark.parametrize("bad", ["", "x" * 300])
def test_bad_subscriber_ids_are_refused_by_name(bad: str) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="subscriber_id"):
            OutputHub().subscribe(bad)

    asyncio.run(main())


def test_a_batch_entry_carries_every_field_of_its_tokens_event() -> None:
    """Entries are built in place, setting only the fields an event has: each must equal
    the Decode stream's own message for the same event (worker.convert.tokens_pb)."""
    from engine.request import LogprobRow
    from worker.convert import tokens_pb

    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        events = [
            TokensEvent("r1", (5, 6), "xy", (LogprobRow(5, -0.5, ((5, -0.5), (7, -1.5))),
                                              LogprobRow(6, -0.25, ())), None,
                        kv_ready_ns=11, first_step_ns=12, cached_tokens=16, notice_sent_ns=8,
                        notice_seen_ns=9, kv_done_ns=10),
            TokensEvent("r2", (), "", (), "error", error="kv transfer failed"),
            TokensEvent("r3", (9,), "z", (), "stop", stop_reason="z"),
            TokensEvent("r4", (1,), "a", (), None),
        ]
        for ev in events:
            hub.attach(ev.rid, a)
            assert hub.add(ev)
        hub.flush()
        batch = await a.next_batch()
        assert len(batch.tokens) == len(events)
        for got, ev in zip(batch.tokens, events, strict=True):
            want = tokens_pb(ev)
            want.request_id = ev.rid
            assert got == want, (got, want)
        first = batch.tokens[0]  # the handoff's stamps, the first message's only
        assert (first.notice_sent_ns, first.notice_seen_ns, first.kv_done_ns,
                first.kv_ready_ns, first.first_step_ns) == (8, 9, 10, 11, 12)
        assert not batch.tokens[3].notice_sent_ns and not batch.tokens[3].kv_done_ns

    asyncio.run(main())


def test_a_columnar_step_builds_the_same_entries_as_its_events() -> None:
    """A step's columnar message (what the engine process sends) gives each subscribed
    request the entry its own event would (worker.convert.tokens_pb, every field), finishes
    detach their requests, and the requests with no subscriber come back for their Decode."""
    from engine.request import LogprobRow
    from worker.convert import tokens_pb
    from worker.messages import decode, encode
    from worker.token_batch import TokensBatchEvent

    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        b, _ = hub.subscribe("router-b")
        events = [
            TokensEvent("r1", (5, 6), "xy", (LogprobRow(5, -0.5, ((5, -0.5), (7, -1.5))),
                                              LogprobRow(6, -0.25, ())), None,
                        kv_ready_ns=11, first_step_ns=12, cached_tokens=16, notice_sent_ns=8,
                        notice_seen_ns=9, kv_done_ns=10),
            TokensEvent("inline", (8,), "p", (), None),
            TokensEvent("r2", (), "", (), "error", error="kv transfer failed"),
            TokensEvent("r3", (9,), "z", (), "stop", stop_reason="z"),
            TokensEvent("r4", (1,), "a", (), None),
        ]
        for ev, sub in zip(events, (a, None, a, b, a), strict=True):
            if sub is not None:
                hub.attach(ev.rid, sub)
        step = decode(encode(TokensBatchEvent.of(events)))
        assert isinstance(step, TokensBatchEvent)
        assert hub.add_batch(step) == [1]
        assert sorted(hub.flush(), key=lambda d: d.rid) == [
            OutputsDone("r2", 1, "error"), OutputsDone("r3", 1, "stop")]
        assert not hub.owns("r2") and not hub.owns("r3") and hub.owns("r1") and hub.owns("r4")
        assert hub.tokens == 4 and hub.batches == 2
        got = list((await a.next_batch()).tokens) + list((await b.next_batch()).tokens)
        for entry, ev in zip(got, [events[i] for i in (0, 2, 4, 3)], strict=True):
            want = tokens_pb(ev)
            want.request_id = ev.rid
            assert entry == want, (entry, want)
        assert (got[0].notice_sent_ns, got[0].notice_seen_ns, got[0].kv_done_ns) == (8, 9, 10)
        assert step.events([1]) == (events[1],)
        # the common decode step: one token for each request
        step = TokensBatchEvent.of([tok("r1", (3,)), tok("inline", (4,)),
                                    tok("r4", (5,), "length")])
        assert hub.add_batch(step) == [1]
        assert hub.flush() == [OutputsDone("r4", 2, "length")]
        assert [(t.request_id, list(t.token_ids), t.text, t.finish_reason)
                for t in (await a.next_batch()).tokens] == [
            ("r1", [3], "d", 0), ("r4", [5], "f", common_pb2.FINISH_REASON_LENGTH)]

    asyncio.run(main())


def test_a_lagging_reader_takes_later_steps_in_one_message_then_a_fresh_one() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        for rid in ("r1", "r2"):
            hub.attach(rid, a)
        hub.add(tok("r1", (1,)))
        hub.flush()
        hub.add(tok("r2", (2,)))
        hub.add(tok("r1", (3,)))
        hub.flush()
        first = await a.next_batch()  # the reader was behind by two steps
        assert first.seq == 2
        assert [(t.request_id, list(t.token_ids)) for t in first.tokens] == [
            ("r1", [1]), ("r2", [2]), ("r1", [3])]
        hub.add(tok("r2", (4,)))
        hub.flush()
        second = await a.next_batch()
        assert second is not first and second.seq == 3
        assert [(t.request_id, list(t.token_ids)) for t in second.tokens] == [("r2", [4])]
        assert len(first.tokens) == 3  # what the reader took is not written to again
        assert hub.batches == 3 and hub.tokens == 4

    asyncio.run(main())


def t0(rid: str, token_id: int = 7, finish: str | None = None) -> Token0Event:
    return Token0Event(rid, token_id, "x", LogprobRow(token_id, -0.5, ((token_id, -0.5),)),
                       finish, "", sampled_ns=100, received_ns=50, cached_tokens=16)


def test_a_steps_token0s_leave_in_one_batch_and_detach_their_requests() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        for rid in ("p1", "p2"):
            hub.attach_token0(rid, a)
        assert hub.running == 0 and not hub.owns("p1")  # their Prefill streams hold them
        hub.attach_token0("p3", a)
        assert hub.add_token0(t0("p1")) and hub.add_token0(t0("p2", 8))
        assert not hub.add_token0(t0("p1"))  # detached at its token 0
        # one that ends its request: its Prefill stream carries it (and then ends)
        assert not hub.add_token0(t0("p3", 9, "stop"))
        assert not hub.add_token0(t0("other"))  # never attached: its Prefill stream
        assert hub.flush() == []  # a token 0 ends nothing the hub counts
        batch = await a.next_batch()
        assert batch.seq == 1 and not batch.tokens
        assert [(e.request_id, e.token_id) for e in batch.token0s] == [("p1", 7), ("p2", 8)]
        e = batch.token0s[1]
        assert (e.text, e.sampled_ns, e.received_ns, e.cached_tokens) == ("x", 100, 50, 16)
        assert e.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        assert e.logprob.token_id == 8 and e.logprob.top[0].logprob == -0.5
        assert e.sent_ns >= e.sampled_ns
        # stamped when the reader took the batch: one moment for the whole batch
        assert batch.token0s[0].taken_ns == e.taken_ns >= e.sent_ns

    asyncio.run(main())


def test_a_token0_whose_subscriber_left_goes_on_its_prefill_stream() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        hub.attach_token0("p1", a)
        hub.attach_token0("p2", a)
        hub.attach_token0("p3", a)
        assert hub.unsubscribe(a) == []  # not handed back: their Prefill streams end them
        assert not hub.add_token0(t0("p1"))
        hub.detach("p2")  # its Prefill stream ended first
        b, _ = hub.subscribe("router-b")
        hub.attach_token0("p2", b)
        hub.fail("engine process failed")
        assert not hub.add_token0(t0("p2")) and not hub.add_token0(t0("p3"))

    asyncio.run(main())


def test_a_started_prefill_sends_token0_then_its_result_and_ends_with_it() -> None:
    """StartPrefill's requests: attached (counted, handed back with their subscriber), token
    0 keeps them attached for the result, which ends them; one whose token 0 ends it ends
    there; a result for a request that is not one is declined (its Prefill stream's)."""
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        for rid in ("s1", "s2", "s3"):
            hub.attach_prefill(rid, a)
        assert hub.running == 3 and hub.prefilling("s1") and hub.owns("s1")
        assert hub.add_token0(t0("s1")) and hub.add_token0(t0("s2", 8, "stop"))
        assert hub.flush() == [OutputsDone("s2", 1, "stop", prefill=True)]
        assert hub.prefilling("s1") and not hub.prefilling("s2") and hub.running == 2
        batch = await a.next_batch()
        assert [(e.request_id, e.finish_reason) for e in batch.token0s] == [
            ("s1", common_pb2.FINISH_REASON_UNSPECIFIED), ("s2", common_pb2.FINISH_REASON_STOP)]
        assert hub.add_transfer(TransferResultEvent("s1", True, "", 2.5))
        assert hub.add_transfer(TransferResultEvent("s3", False, "busy", 0.0, busy=True))
        assert not hub.add_transfer(TransferResultEvent("s1", True, "", 1.0))  # ended
        assert not hub.add_transfer(TransferResultEvent("stream", True, "", 1.0))
        assert hub.flush() == [OutputsDone("s1", 2, "transferred", prefill=True),
                               OutputsDone("s3", 2, "busy", prefill=True)]
        batch = await a.next_batch()
        assert [(e.request_id, e.ok, e.busy, e.kv_transfer_ms) for e in batch.transfers] == [
            ("s1", True, False, 2.5), ("s3", False, True, 0.0)]
        assert hub.running == 0 and not hub.owns("s1")
        # a subscriber that leaves hands its started prefills back (to abort)
        hub.attach_prefill("s4", a)
        assert hub.unsubscribe(a) == ["s4"] and not hub.prefilling("s4")
        b, _ = hub.subscribe("router-b")
        hub.attach_prefill("s5", b)
        hub.fail("engine process failed")
        assert not hub.prefilling("s5") and not hub.add_transfer(
            TransferResultEvent("s5", False, "x", 0.0))

    asyncio.run(main())


class FakeSink:
    def __init__(self, ready: bool) -> None:
        self.is_ready = ready
        self.written: list[worker_pb2.OutputBatch] = []

    def ready(self) -> bool:
        return self.is_ready

    def write(self, batch: worker_pb2.OutputBatch) -> None:
        self.written.append(batch)


def test_a_parked_readers_sink_takes_each_step_in_the_flush() -> None:
    """With a sink set (a reader parked on a stream that writes synchronously), flush hands
    it the step's batch and queues nothing; a sink that is not ready (backpressure) leaves
    the batch queued, and the next step merges into it for the reader."""
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        hub.attach("r1", a)
        sink = FakeSink(ready=True)
        a.sink = sink
        hub.add(TokensEvent("r1", (1,), "a", (), None))
        hub.flush()
        assert [b.seq for b in sink.written] == [1] and not a.has_queued
        assert [list(t.token_ids) for t in sink.written[0].tokens] == [[1]]
        sink.is_ready = False  # past the socket's mark: the reader's task takes over
        hub.add(TokensEvent("r1", (2,), "b", (), None))
        hub.flush()
        hub.add(TokensEvent("r1", (3,), "c", (), None))
        hub.flush()
        assert len(sink.written) == 1 and a.has_queued
        a.sink = None  # the reader resumes
        batch = await a.next_batch()
        assert batch.seq == 3 and [list(t.token_ids) for t in batch.tokens] == [[2], [3]]

    asyncio.run(main())


def test_token0s_written_by_the_sink_carry_when_they_left() -> None:
    async def main() -> None:
        hub = OutputHub()
        a, _ = hub.subscribe("router-a")
        sink = FakeSink(ready=True)
        a.sink = sink
        hub.attach_token0("p1", a)
        assert hub.add_token0(t0("p1"))
        hub.flush()
        (e,) = sink.written[0].token0s
        assert e.request_id == "p1" and e.taken_ns >= e.sent_ns > 0

    asyncio.run(main())
