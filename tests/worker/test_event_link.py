"""The events link (worker/event_link.py) over a real Unix socket: messages arrive whole and in
order however the stream splits them, a frame that cannot be one ends the link after the
messages before it, the engine's exit ends it after every message it sent, nobody but the
one engine connects, and the writer waits for a slow reader only past MAX_PENDING."""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from event_link_pair import events_pair, received

from worker import event_link, ipc
from worker.event_link import EventReader, EventWriter, LinkClosed, NothingQueued, frame


def _drain_until_closed(reader: EventReader) -> tuple[list[list[bytes]], str]:
    got: list[list[bytes]] = []
    while True:
        try:
            got.append(reader.recv_multipart())
        except NothingQueued:
            assert select.select([reader.fileno()], [], [], 5)[0], "nothing came"
        except LinkClosed as e:
            return got, str(e)


@pytest.fixture
def link() -> Iterator[tuple[str, EventReader, EventWriter]]:
    """(the socket's path, the gRPC process's end, the engine's end), connected."""
    paths = ipc.IpcPaths.fresh()
    reader, writer = events_pair(paths.events)
    yield paths.events, reader, writer
    writer.close(wait_s=0)
    reader.close()
    paths.cleanup()


@pytest.fixture
def raw_link() -> Iterator[tuple[EventReader, socket.socket]]:
    """The gRPC process's end, and a plain socket in the engine's place: any bytes at all."""
    paths = ipc.IpcPaths.fresh()
    reader = EventReader(paths.events)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(paths.events)
    assert reader.accept_now()
    yield reader, raw
    raw.close()
    reader.close()
    paths.cleanup()


def test_messages_arrive_whole_and_in_order(link: tuple[str, EventReader, EventWriter]) -> None:
    _, reader, writer = link
    msgs = [[b"a"], [b"", b"bc", b""], [os.urandom(3 << 20)], [b"x" * n for n in range(40)]]

    def write() -> None:  # past the kernel's buffer the writer waits for the reader
        for m in msgs:
            writer.send_multipart(m)
        writer.close()

    t = threading.Thread(target=write)
    t.start()
    got, why = _drain_until_closed(reader)
    t.join(5)
    assert got == msgs
    assert "closed its end" in why


def test_a_stream_split_anywhere_gives_the_same_messages(
        raw_link: tuple[EventReader, socket.socket]) -> None:
    """Byte by byte: every frame is reassembled from its pieces."""
    reader, raw = raw_link
    msgs = [[b"first", b"second"], [b"third"]]
    data = b"".join(frame(m) for m in msgs)
    got: list[list[bytes]] = []
    for i in range(len(data)):
        raw.sendall(data[i:i + 1])
        got += received(reader, 0.01)
    assert got == msgs


@pytest.mark.parametrize("bad", [
    struct.pack("<I", 1 << 30),  # longer than any message
    struct.pack("<II", 8, 5) + b"\0" * 4,  # five parts' lengths do not fit in 8 bytes
    struct.pack("<III", 8, 1, 7),  # a part of 7 bytes in a frame with room for none
])
def test_a_frame_that_is_not_one_ends_the_link_after_the_good_ones(
        bad: bytes, raw_link: tuple[EventReader, socket.socket]) -> None:
    reader, raw = raw_link
    raw.sendall(frame([b"ok"]) + bad + frame([b"never"]))
    got, why = _drain_until_closed(reader)
    assert got == [[b"ok"]]
    assert "frame" in why


def test_only_one_engine_connects(link: tuple[str, EventReader, EventWriter]) -> None:
    path, reader, writer = link
    # the socket file went with the listener once the engine connected
    assert not os.path.exists(path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        other.connect(path)
    other.close()
    writer.send_multipart([b"still served"])
    assert received(reader) == [[b"still served"]]


def test_the_socket_is_private_while_it_listens() -> None:
    paths = ipc.IpcPaths.fresh()
    reader = EventReader(paths.events)
    try:
        assert stat.S_IMODE(os.stat(paths.events).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(paths.events)).st_mode) == 0o700
    finally:
        reader.close()
        paths.cleanup()
    assert not os.path.exists(os.path.dirname(paths.events))


def test_a_writer_whose_reader_is_behind_holds_the_rest_and_sends_it_in_order(
        link: tuple[str, EventReader, EventWriter]) -> None:
    """The engine never waits on a slow gRPC process below MAX_PENDING: what the socket does
    not take waits in the writer and leaves, in order, at its next flush."""
    _, reader, writer = link
    msgs = [[i.to_bytes(4, "little") * 64] for i in range(4000)]  # ~1 MB, unread
    t0 = time.monotonic()
    for m in msgs:
        writer.send_multipart(m)
    assert time.monotonic() - t0 < 2.0
    assert writer.pending_bytes > 0  # more than the kernel took
    got: list[list[bytes]] = []
    while len(got) < len(msgs):
        writer.flush()  # the engine loop's turn
        got += received(reader, 0.01)
    assert got == msgs and writer.pending_bytes == 0


def test_past_max_pending_the_writer_waits_for_the_reader(
        monkeypatch: pytest.MonkeyPatch, link: tuple[str, EventReader, EventWriter]) -> None:
    monkeypatch.setattr(event_link, "MAX_PENDING", 64 << 10)
    _, reader, writer = link
    msgs = [[bytes([i % 251]) * 1024] for i in range(2000)]  # 2 MB
    t = threading.Thread(target=lambda: [writer.send_multipart(m) for m in msgs])
    t.start()
    t.join(0.5)
    assert t.is_alive()  # held back: nobody reads
    assert writer.pending_bytes <= (64 << 10) + 2048
    got: list[list[bytes]] = []
    while t.is_alive() or writer.pending_bytes:
        got += received(reader, 0.01)
        if not t.is_alive():
            writer.flush()
    got += received(reader, 0.05)
    assert got == msgs
