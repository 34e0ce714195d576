"""One request's KV transfer on the producer (``Outgoing.phase``), checked at every change.

Lifecycle, as ``ProducerHandler`` walks it:

1. ``AWAITING_DEST``: the prefill runs; where its KV goes is not known yet. The router's
   ``HoldCmd`` renews the lease while the consumer's reservation waits for blocks.
2. ``PUSHING``: the consumer's blocks came (``DestinationCmd``); after each chunk, the
   blocks it filled are pushed (and pinned) at once.
3. ``TOKEN0_HELD``: token 0 was sampled; the final notice is built but waits until the
   gRPC process has put token 0 on the router's stream (``Token0SentCmd``), so token 0
   reaches the client before the consumer can decode. Reached from ``PUSHING``, or from
   ``TOKEN0_AWAITING_DEST`` when the destination comes after token 0.
4. ``RELEASED``: token 0 is on the router's stream; the remaining blocks and the final
   notice go with the next push (within the same call, unless the push fails). Reached
   from ``TOKEN0_HELD``, or from ``RELEASED_AWAITING_DEST`` when the destination comes.
5. ``NOTIFIED``: the final notice was sent; the consumer's ack (the sender's DONE) ends
   it. The lease is now the transfer timeout.
6. ``CANCELLING``: ended (abort, failure, lease expiry, token 0 finished the request)
   after pushes began: the sender owns the transfer's end, and its terminal report
   releases the pinned blocks.
7. ``ENDED``: the record is dropped (acked, failed before any push, or the sender's
   terminal report came).

Token 0 can come before the destination (a consumer's reservation queued behind others):
then ``AWAITING_DEST -> TOKEN0_AWAITING_DEST -> RELEASED_AWAITING_DEST`` wait for it, and
the destination moves them to ``TOKEN0_HELD`` / ``RELEASED``. Token 0 that finishes the
request (EOS, a stop, ``max_tokens`` 1) builds no notice: the record ends, through
``CANCELLING`` if blocks were pushed.

Timeouts: until the destination the lease (``lease_s``, renewed by holds and by token 0);
from the destination on the lease again, renewed by token 0; after the final notice
``transfer_timeout_s`` for the ack; every push also carries the sender's own deadline.
The engine's ``RequestState`` (engine/request_state.py) is the request's state in the
engine; this is the transfer's, which the engine does not see.
"""

from __future__ import annotations

from enum import IntEnum


class TransferPhase(IntEnum):
    AWAITING_DEST = 0
    PUSHING = 1
    TOKEN0_AWAITING_DEST = 2
    RELEASED_AWAITING_DEST = 3
    TOKEN0_HELD = 4
    RELEASED = 5
    NOTIFIED = 6
    CANCELLING = 7
    ENDED = 8

    @property
    def awaits_dest(self) -> bool:
        """No destination yet: holds renew the lease, a DestinationCmd is taken."""
        return self in _AWAITING

    @property
    def has_dest(self) -> bool:
        """The consumer's blocks are known and blocks may be pushed to them."""
        return self in _DEST_KNOWN

    @property
    def token0_out(self) -> bool:
        """Token 0 was sampled and the final notice built (sent or not)."""
        return self in _TOKEN0_OUT

    def with_dest(self) -> TransferPhase:
        """Where the destination's arrival moves a phase that awaits it."""
        return _after(_WITH_DEST, self, "the destination")

    def with_token0(self) -> TransferPhase:
        """Where token 0 (not finishing the request) moves a phase before it."""
        return _after(_WITH_TOKEN0, self, "token 0")

    def with_token0_sent(self) -> TransferPhase | None:
        """Where Token0SentCmd moves a phase (None: it changes nothing there, as in a
        record token 0 finished)."""
        return _WITH_TOKEN0_SENT.get(self)


class BadTransfer(RuntimeError):
    """A transfer phase change the table does not list: a bug in the producer."""


T = TransferPhase
_AWAITING = frozenset({T.AWAITING_DEST, T.TOKEN0_AWAITING_DEST, T.RELEASED_AWAITING_DEST})
_DEST_KNOWN = frozenset({T.PUSHING, T.TOKEN0_HELD, T.RELEASED, T.NOTIFIED})
_TOKEN0_OUT = frozenset({T.TOKEN0_AWAITING_DEST, T.RELEASED_AWAITING_DEST, T.TOKEN0_HELD,
                         T.RELEASED, T.NOTIFIED})
_WITH_DEST = {T.AWAITING_DEST: T.PUSHING, T.TOKEN0_AWAITING_DEST: T.TOKEN0_HELD,
              T.RELEASED_AWAITING_DEST: T.RELEASED}
_WITH_TOKEN0 = {T.AWAITING_DEST: T.TOKEN0_AWAITING_DEST, T.PUSHING: T.TOKEN0_HELD}
_WITH_TOKEN0_SENT = {T.TOKEN0_AWAITING_DEST: T.RELEASED_AWAITING_DEST,
                     T.TOKEN0_HELD: T.RELEASED}

# (from, to) -> why. The one source of truth for TransferPhase: ``check_transfer``, the
# lifecycle above and docs/architecture.md describe this table.
TRANSFER_EDGES: dict[tuple[TransferPhase, TransferPhase], str] = {
    **{(a, b): "the consumer's blocks came (DestinationCmd)" for a, b in _WITH_DEST.items()},
    **{(a, b): "token 0 sampled; the final notice is built" for a, b in _WITH_TOKEN0.items()},
    **{(a, b): "token 0 is on the router's stream (Token0SentCmd)"
       for a, b in _WITH_TOKEN0_SENT.items()},
    (T.RELEASED, T.NOTIFIED): "the final notice went with the last push",
    # pushes may have begun only where the destination is known
    **{(p, T.CANCELLING): "ended after pushes began: the sender cancels and reports"
       for p in _DEST_KNOWN},
    **{(p, T.ENDED): "dropped: acked, failed, or ended before any push"
       for p in T if p is not T.ENDED},
}


def _after(table: dict[TransferPhase, TransferPhase], old: TransferPhase,
           event: str) -> TransferPhase:
    new = table.get(old)
    if new is None:
        raise BadTransfer(f"transfer phase: {event} in {old.name} is not an edge of a "
                          "producer's transfer (producer/transfer_phase.py)")
    return new


def check_transfer(old: TransferPhase, new: TransferPhase) -> None:
    if (old, new) not in TRANSFER_EDGES:
        raise BadTransfer(f"transfer phase: {old.name} -> {new.name} is not an edge of a "
                          "producer's transfer (producer/transfer_phase.py)")
