"""The router's view of one request's life (``RequestRun.phase``), checked at every change.

Lifecycle, as the client loop of ``RequestRun.stream`` walks it:

1. ``QUEUED``: admitted or waiting for admission; no worker chosen yet.
2. ``PLACED``: a slot is chosen and its legs started. Disaggregated, the producer prefills
   while the consumer reserves blocks for the prompt; colocated, the worker prefills.
3. ``PAIRED``: the consumer reserved; the producer has been told where to write the KV.
4. ``TOKEN0``: token 0 went to the client; the producer's KV transfer is finishing.
5. ``KV_LANDED``: the producer reported the transfer done; the consumer's first token is
   pending.
6. ``DECODING``: the decoding leg's tokens stream to the client (colocated: from its first
   token on, token 0 included).
7. ``FINISHED_*``: the final message went out, or the client left (``FINISHED_ABORTED``).

Reports never move a request back: the consumer's reservation arriving after token 0, or
the transfer result after the consumer's first token, leaves the phase where it is
(``advance``). The only backward edges are a new placement (``replace``): a producer lost
before token 0 sends the request to another producer (retry), any other worker failure
sends it, with the tokens already streamed, to another slot (migration). Both return to
``PLACED``.

The engine's own states (``engine.request_state``) are what one worker does with the
request; this is what the router knows of all its legs together, so the two enums share
no edges.
"""

from __future__ import annotations

from enum import IntEnum


class RunPhase(IntEnum):
    QUEUED = 0
    PLACED = 1
    PAIRED = 2
    TOKEN0 = 3
    KV_LANDED = 4
    DECODING = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9

    @property
    def finished(self) -> bool:
        return self >= RunPhase.FINISHED_STOPPED


class BadPhase(RuntimeError):
    """A phase change the table does not list: a bug in the router."""


P = RunPhase
_UNFINISHED = [p for p in P if not p.finished]
_PLACED_ONCE = (P.PLACED, P.PAIRED, P.TOKEN0, P.KV_LANDED, P.DECODING)

# (from, to) -> why. The one source of truth for RunPhase: ``check_phase``, the lifecycle
# above and docs/architecture.md describe this table.
PHASE_EDGES: dict[tuple[RunPhase, RunPhase], str] = {
    (P.QUEUED, P.PLACED): "admitted and placed; legs started",
    (P.PLACED, P.PAIRED): "the consumer reserved; its blocks went to the producer",
    (P.PLACED, P.TOKEN0): "token 0 came before the consumer's reservation",
    (P.PAIRED, P.TOKEN0): "token 0 went to the client",
    (P.TOKEN0, P.KV_LANDED): "the producer's transfer result is ok",
    (P.TOKEN0, P.DECODING): "the consumer's first token came before the transfer result",
    (P.KV_LANDED, P.DECODING): "the consumer's first token",
    (P.PLACED, P.DECODING): "colocated: the worker's first token",
    **{(p, P.PLACED): "placed again: retry on another producer, or migration"
       for p in _PLACED_ONCE},
    # token 0 (a stop, or max_tokens 1) or the decoding leg ends it normally
    **{(p, f): "a leg finished the request" for p in (P.PLACED, P.PAIRED, P.TOKEN0,
                                                      P.KV_LANDED, P.DECODING)
       for f in (P.FINISHED_STOPPED, P.FINISHED_LENGTH)},
    **{(p, P.FINISHED_ABORTED): "Router.Abort, or the client left" for p in _UNFINISHED},
    **{(p, P.FINISHED_ERROR): "a leg failed with no way to recover, a timeout, shutdown"
       for p in _UNFINISHED},
}


def check_phase(old: RunPhase, new: RunPhase) -> None:
    if (old, new) not in PHASE_EDGES:
        raise BadPhase(f"phase: {old.name} -> {new.name} is not an edge of a request's run "
                       "(router/requests/run_phase.py)")
