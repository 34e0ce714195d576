"""A request's lifecycle inside a worker: engine, producer and consumer (docs/architecture.md).

One enum for every place a request lives inside a worker; ``EDGES`` is the state diagram,
and ``check_transition`` refuses any edge it does not list, so the diagram below is what
the code does (``Request.move`` in the engine and the role handlers go through it).

Inside a worker (the engine, the producer's and the consumer's handlers)::

                add (local)            scheduler admits (blocks, seat, token budget)
    (new) ───────────────────▶ QUEUED ─────────────────────────────▶ PREFILLING
      │                          ▲  ▲  preempted (blocks dropped,       │   │
      │ add_remote (consumer)    │  └──── recomputed later) ────────────┘   │ token 0
      ▼                          │                                          │ (colocated,
    RESERVING ─scheduler admits─▶ WAITING_FOR_KV ──kv_landed──▶ DECODING ◀──┘  consumer)
      (blocks for the prompt,     (the transfer fills            │  ▲ │
       a seat; FIFO)               the reserved blocks)          │  └─┘ preempted ──▶ QUEUED
                                                                 ▼
    PREFILLING ──token 0 sampled, prefill_only (producer)──▶ TRANSFERRING ──ack──▶ released
    PREFILLING / DECODING ──EOS, stop token or string / max_tokens──▶ FINISHED_STOPPED / _LENGTH
    any unfinished state ──abort (router, client gone)──▶ FINISHED_ABORTED
                         ──transfer failed, lease or deadline passed──▶ FINISHED_ERROR

Who makes each edge: the scheduler (QUEUED/RESERVING admissions, preemption back to
QUEUED), the engine's step (PREFILLING -> DECODING / TRANSFERRING / FINISHED_*), the
consumer handler through ``LLMEngine.kv_landed`` (WAITING_FOR_KV -> DECODING) and
``LLMEngine.abort`` (FINISHED_ABORTED / FINISHED_ERROR), the producer handler through
``abort`` and ``release`` (TRANSFERRING ends in release once the consumer acked: the
request lives on at the consumer, so the producer just forgets it).

The router keeps its own view of a request across all its legs, with its own enum and
edges (``RunPhase``, router/requests/run_phase.py): a producer lost before token 0 or a
consumer lost mid-decode makes a new request on other workers there, never a backward
edge here.

Timeouts guarding each state: QUEUED by the router's admission queue and client deadline
(and a worker's ``max_waiting``); RESERVING by the router's ``token0_timeout_s`` (the
consumer keeps it queued until blocks free); WAITING_FOR_KV by the consumer's
``reservation_s`` (the receiver's deadline) and the transfer peer timeout; PREFILLING by
``token0_timeout_s``; TRANSFERRING by the producer's lease (``lease_s``: a destination and
then the consumer's ack must come in time) and ``transfer_timeout_s``; DECODING by the
router's ``token_timeout_s`` between tokens. A lease or deadline that frees blocks logs a
line naming the request and the state it was in.
"""

from __future__ import annotations

from enum import IntEnum


class RequestState(IntEnum):
    QUEUED = 0  # waiting for the scheduler (or re-queued after preemption)
    RESERVING = 1  # consumer: waiting for destination blocks
    PREFILLING = 2  # prompt chunks being computed
    TRANSFERRING = 3  # producer: token 0 sampled, blocks held until the consumer acks
    WAITING_FOR_KV = 4  # consumer: blocks reserved, KV and token 0 not all landed yet
    DECODING = 5
    FINISHED_STOPPED = 6  # EOS, stop token or stop string
    FINISHED_LENGTH = 7  # max_tokens or max_model_len
    FINISHED_ABORTED = 8
    FINISHED_ERROR = 9

    @property
    def finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _REASONS.get(self)


class BadTransition(RuntimeError):
    """A state change the diagram does not list: a bug in whoever attempted it."""


S = RequestState
_REASONS = {
    S.FINISHED_STOPPED: "stop",
    S.FINISHED_LENGTH: "length",
    S.FINISHED_ABORTED: "abort",
    S.FINISHED_ERROR: "error",
}
_UNFINISHED = [s for s in S if not s.finished]

# (from, to) -> who makes it and why. The one source of truth: check_transition, the
# docstring above and docs/architecture.md describe this table.
EDGES: dict[tuple[RequestState, RequestState], str] = {
    (S.QUEUED, S.PREFILLING): "scheduler: admitted (blocks, seat, token budget)",
    (S.RESERVING, S.WAITING_FOR_KV): "scheduler: remote request given its prompt's blocks",
    (S.PREFILLING, S.QUEUED): "scheduler: preempted, KV dropped to be recomputed",
    (S.DECODING, S.QUEUED): "scheduler: preempted, KV dropped to be recomputed",
    (S.PREFILLING, S.DECODING): "engine: the last prompt chunk was launched (samples token 0)",
    (S.PREFILLING, S.TRANSFERRING): "engine: producer's token 0 sampled; blocks held for the "
                                    "transfer",
    (S.WAITING_FOR_KV, S.DECODING): "consumer: KV and token 0 landed (kv_landed)",
    (S.PREFILLING, S.FINISHED_STOPPED): "engine: token 0 was a stop (producer, direct output)",
    (S.PREFILLING, S.FINISHED_LENGTH): "engine: token 0 hit max_model_len (producer)",
    (S.DECODING, S.FINISHED_STOPPED): "engine: EOS, stop token or stop string",
    (S.DECODING, S.FINISHED_LENGTH): "engine: max_tokens or max_model_len",
    **{(s, S.FINISHED_ABORTED): "anyone: aborted (router, client gone)" for s in _UNFINISHED},
    **{(s, S.FINISHED_ERROR): "anyone: a transfer failed, a lease or deadline passed"
       for s in _UNFINISHED},
}


def check_transition(old: RequestState, new: RequestState) -> None:
    if (old, new) not in EDGES:
        raise BadTransition(f"state: {old.name} -> {new.name} is not an edge of the request "
                            "lifecycle (engine/request_state.py)")
