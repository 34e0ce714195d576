"""Bounded per-request event queues and the engine link's high-water mark: a lagging reader
gets token events merged (nothing lost), anything else past the bound fails the request
loudly, and a new request is refused (not queued) once the engine is a mark behind."""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from worker import ipc
from worker.messages import AbortCmd, DecodeCmd, FatalEvent, ReservedEvent
from worker.request_queue import RequestQueue
from worker.servicer import EngineBridge, EngineBusy
from worker.token_batch import TokensEvent


def tok(i: int, finish: str | None = None) -> TokensEvent:
    return TokensEvent("r", (i,), f"t{i}", (), finish, kv_ready_ns=i if i == 0 else 0)


def test_a_lagging_reader_gets_merged_token_events_and_loses_nothing() -> None:
    async def main() -> None:
        q = RequestQueue("r", max_events=4)
        q.put_nowait(ReservedEvent("r", "addr", (1, 2)))
        for i in range(50):
            q.put_nowait(tok(i, "length" if i == 49 else None))
        assert q.qsize() == 4 and q.merged == 47 and not q.overflowed
        got = [await q.get() for _ in range(4)]
        assert got[0] == ReservedEvent("r", "addr", (1, 2))
        toks = [t for ev in got[1:] for t in ev.ids]  # type: ignore[union-attr]
        assert toks == list(range(50))
        assert "".join(ev.text for ev in got[1:]) == "".join(f"t{i}" for i in range(50))  # type: ignore[union-attr]
        assert got[1].kv_ready_ns == 0 and got[-1].finish == "length"  # type: ignore[union-attr]

    asyncio.run(main())


def test_merged_token_events_keep_the_first_message_s_stamps() -> None:
    async def main() -> None:
        q = RequestQueue("r", max_events=2)
        q.put_nowait(ReservedEvent("r", "addr", (1,)))
        q.put_nowait(TokensEvent("r", (1,), "a", (), None, kv_ready_ns=5, first_step_ns=6,
                                 notice_sent_ns=2, notice_seen_ns=3, kv_done_ns=4))
        q.put_nowait(TokensEvent("r", (2,), "b", (), None, kv_ready_ns=50, first_step_ns=60,
                                 notice_sent_ns=20, notice_seen_ns=30, kv_done_ns=40))
        q.put_nowait(TokensEvent("r", (3,), "c", (), "length"))
        assert isinstance(await q.get(), ReservedEvent)
        ev = await q.get()
        assert isinstance(ev, TokensEvent) and ev.ids == (1, 2, 3) and q.merged == 2
        assert (ev.notice_sent_ns, ev.notice_seen_ns, ev.kv_done_ns, ev.kv_ready_ns,
                ev.first_step_ns) == (2, 3, 4, 5, 6)

    asyncio.run(main())


def test_overflow_that_cannot_merge_fails_the_request_loudly() -> None:
    async def main() -> None:
        q = RequestQueue("r", max_events=2)
        q.put_nowait(tok(0, "stop"))  # finished: nothing may merge into it
        q.put_nowait(tok(1, "stop"))
        q.put_nowait(ReservedEvent("r", "a", ()))
        assert q.overflowed
        ev = await q.get()
        assert isinstance(ev, FatalEvent) and "fell 2 events behind" in ev.error
        q.put_nowait(tok(2))  # ignored: the request is over
        assert q.qsize() == 0

    asyncio.run(main())


def test_get_waits_for_a_put() -> None:
    async def main() -> None:
        q = RequestQueue("r")
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.01)
        assert not getter.done()
        q.put_nowait(tok(7))
        assert (await asyncio.wait_for(getter, 1)).ids == (7,)  # type: ignore[union-attr]

    asyncio.run(main())


def test_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="^max_events:"):
        RequestQueue("r", max_events=1)


def test_new_requests_are_refused_once_the_engine_is_a_high_water_mark_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "HWM", 5)

    async def main() -> None:
        paths = ipc.IpcPaths.fresh()
        bridge = EngineBridge(paths)  # no engine process: nothing reads the commands
        try:
            sent = 0
            with pytest.raises(EngineBusy, match="commands behind"):
                for sent in range(1, 1000):
                    bridge.send_new(DecodeCmd(f"r{sent}", (1,), SamplingParams(), False))
            assert 5 <= sent <= 20  # the bound held, near the mark
            bridge.send(AbortCmd("r1"))  # aborts are never refused
        finally:
            bridge.close()
            paths.cleanup()

    asyncio.run(main())
