"""The request lifecycle shared by router, producer and consumer (docs/architecture.md).

Ordered: a request only moves forward. Torch-free so every service can import it.
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


_REASONS = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "abort",
    RequestState.FINISHED_ERROR: "error",
}
