"""The events link's two ends in one test process (worker/event_link.py), for tests of the
engine loop that read what it sent, or only need somewhere for it to go."""

from __future__ import annotations

import select

from worker.event_link import EventReader, EventWriter, NothingQueued


def events_pair(path: str) -> tuple[EventReader, EventWriter]:
    reader = EventReader(path)
    writer = EventWriter(path)  # a Unix connect completes against the listener's backlog
    assert reader.accept_now()
    return reader, writer


def received(reader: EventReader, wait_s: float = 0.2) -> list[list[bytes]]:
    """Every message that arrives until none came for ``wait_s``."""
    out: list[list[bytes]] = []
    while True:
        try:
            out.append(reader.recv_multipart())
            continue
        except NothingQueued:
            pass
        if not select.select([reader.fileno()], [], [], wait_s)[0]:
            return out
