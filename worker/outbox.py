"""The engine process's side of the events link: what one phase of a loop turn emitted
(the commands' answers before the forward; the step's tokens, the reservations and
transfers polled after it, the prefix-cache events and the load report at the turn's end)
leaves as one message of parts on the events link (worker/event_link.py). The gRPC process
then reads a step with one receive and one wake-up of its loop, and routes it in one pass,
so the step's reservations and tokens share one Outputs batch; each part is one message of
``worker.messages``, decoded as before.
"""

from __future__ import annotations

from typing import Protocol

from worker.messages import Event, encode


class EventSink(Protocol):
    """Where a flush goes: the events link's writer (worker/event_link.py)."""

    def send_multipart(self, parts: list[bytes]) -> None: ...

    def flush(self) -> None: ...


class EventOutbox:
    def __init__(self, sock: EventSink) -> None:
        self.sock = sock
        self.parts: list[bytes] = []

    def emit(self, ev: Event) -> None:
        """Encodes now (the message is the event as it is now); sends at ``flush``."""
        self.parts.append(encode(ev))

    def flush(self) -> None:
        if self.parts:
            parts, self.parts = self.parts, []
            self.sock.send_multipart(parts)
        else:  # what the link's writer still holds from earlier sends
            self.sock.flush()
