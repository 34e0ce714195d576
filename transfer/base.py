"""The transfer contract: a producer-side sender and a consumer-side receiver.

Ownership: a transfer record lives from its first ``push`` / ``expect`` until the caller
``release``s it, which is allowed only once ``poll`` reported it terminal. A terminal status
means no byte of it will be read (sender) or written (receiver) again, so the caller may
free / reuse its blocks exactly then. Cancels and deadlines first drain the operations
already posted, so CANCELLED/TIMED_OUT can follow the cancel by up to the peer timeout.

Threading: every method is thread-safe and non-blocking (except ``connect`` and ``close``)
so an engine loop can call them between steps; real backends do all network work on one
background I/O thread per sender/receiver, plus UCX's own progress thread.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any

from transfer.types import (
    Accounting,
    TransferNotice,
    TransferStats,
    TransferStatus,
    TransferUpdate,
)


class _Side(abc.ABC):
    @abc.abstractmethod
    def poll(self) -> list[TransferUpdate]:
        """Terminal updates since the last poll, each reported exactly once."""

    @abc.abstractmethod
    def status(self, request_id: str) -> TransferStatus:
        """Current status; raises KeyError for an unknown or released request."""

    @abc.abstractmethod
    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stops the transfer and tells the peer; a no-op on terminal or unknown requests."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forgets a terminal record; raises ValueError if it is not terminal yet."""

    @abc.abstractmethod
    def accounting(self) -> Accounting:
        """This side's own books (tests check they return to empty)."""

    @abc.abstractmethod
    def stats(self) -> TransferStats:
        """Counters of what peers sent that was dropped (thread-safe, cheap)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fails what is left, closes peers and deregisters the pool. Idempotent."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self, request_id: str, timeout: float) -> TransferUpdate:
        """Test/bench helper: polls until ``request_id`` is terminal. Not for engine loops."""
        end = time.monotonic() + timeout
        while True:
            found = None
            for u in self.poll():
                if u.request_id == request_id and found is None:
                    found = u
                else:
                    self._stash(u)
            if found is not None:
                return found
            if time.monotonic() > end:
                raise TimeoutError(f"{request_id}: not terminal after {timeout} s")
            time.sleep(0.0005)

    def _stash(self, u: TransferUpdate) -> None:
        # wait() consumed another request's update: hand it back on the next poll
        self._stashed = [*getattr(self, "_stashed", []), u]

    def _take_stashed(self) -> list[TransferUpdate]:
        out, self._stashed = getattr(self, "_stashed", []), []
        return out


class KVSender(_Side):
    """Producer side: pushes source block runs into a consumer's reserved blocks."""

    @abc.abstractmethod
    def connect(self, address: str, timeout: float | None = None) -> None:
        """Handshakes with the receiver advertised at ``address`` (blocking, idempotent).

        Raises HandshakeError naming what differs (version, backend, layout fields)."""

    @abc.abstractmethod
    def push(self, request_id: str, peer: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], deadline: float | None = None,
             after: object | None = None) -> None:
        """Queues src blocks -> dst blocks (one message per contiguous run).

        Between workers of different TP each rank pushes to every consumer rank
        ``tp_plan.parts_from`` gives it (only its part of their heads moves); ``finish``
        then goes to all of them and DONE waits for each one's ack.

        The first push of a request creates its record with ``deadline`` (a
        ``time.monotonic()`` value; default now + config.transfer_timeout_s). On CUDA the
        current stream's work on the source blocks is awaited before bytes move: all of it
        so far, or, given ``after`` (a torch.cuda.Event recorded after the kernels that
        wrote them), only that, so a push made while a later step runs need not wait for
        it (StepResult.kv_written)."""

    @abc.abstractmethod
    def finish(self, request_id: str, notice: TransferNotice) -> None:
        """The last message: token 0 and sampling state. DONE follows the consumer's ack."""


class KVReceiver(_Side):
    """Consumer side: accepts pushes into blocks it reserved, acks when all landed."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What producers pass to ``connect`` (e.g. ``tcp://10.0.0.2:41234``)."""

    def address_for(self, request_id: str) -> str:
        """Where producers push ``request_id``'s KV, once it is expected: ``address``,
        except on a worker of attention data-parallel groups, whose address for a request
        names only the ranks of the group holding its blocks (``transfer.tp_receiver``)."""
        return self.address

    @abc.abstractmethod
    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               deadline: float | None = None, source_tp: int | None = None) -> None:
        """Reserves the request's blocks for pushes; DONE carries the notice.

        ``source_tp``: the producer's TP size (default: ours). This rank then takes its
        heads from the producer ranks ``transfer.tp_plan`` names, and is DONE once every
        one of them finished and all their runs landed; it ends as a whole."""

    def take_ready(self) -> list[str]:
        """Requests ``expect``ed since the last call that producers may now push to, in the
        order they became ready: a consumer tells the producer where to write only then.
        A receiver of one pool is ready when ``expect`` returns; one spread over TP ranks
        (``transfer.tp_receiver``) once every rank holds the record."""
        out: list[str] = getattr(self, "_ready", [])
        self._ready: list[str] = []
        return out

    def _now_ready(self, request_id: str) -> None:
        self.__dict__.setdefault("_ready", []).append(request_id)  # no __init__ in the contract
