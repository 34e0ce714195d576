"""Publishing the engine's prefix-cache events to the router (Registry.PublishKVEvents), for
its cache-aware placement.

Lifecycle: the bridge hands every KV event to ``add`` (on the gRPC process's loop); ``run``
sends what is pending at most every ``interval_s``, in one batch. Under a steady stream of
events the send rides the loop wake-up that brought the first event after the interval (no
timer of its own: a timer's wake-up of the loop cost ~0.3 ms of CPU on a 2-core VM, as much as
the call); a lone event with nothing after it leaves at the latest two intervals after the
last send. The router answers
``resync`` when its view of this worker is missing or has a gap (it restarted, this worker
registered again, a batch was lost): the next batch then carries a snapshot of the mirror
(worker/kv_mirror.py) and the events after it. The pending events are bounded: past
MAX_PENDING_HASHES they are dropped and a snapshot replaces them. A new engine (a restart, a
role change) is a new publisher with a new ``epoch``, whose seq starts again at 1.

Everything here is advisory: the router only uses the index to choose where a request runs,
so a lost batch costs cache hits until the resync, never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import cast

import grpc
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from worker.kv_mirror import KVMirror
from worker.messages import KVBlocksEvent, KVEventsEvent, KVSnapshotEvent

log = logging.getLogger("pdserve.worker")
# How often a batch may leave. The first events after a quiet spell leave at once; under a
# steady stream (a consumer decoding fills blocks every few steps) one call carries this
# long's events. Each call costs the gRPC process a unary RPC (~0.3-0.5 ms of CPU here):
# at 0.05 s that was ~7% of a consumer's service CPU at 1k tokens/s. An index up to 0.2 s
# behind costs only the hits of requests placed within that time of a prefix's first use.
PUBLISH_INTERVAL_S = 0.2
# Hashes waiting to be published before they are dropped for a snapshot (32 bytes each).
MAX_PENDING_HASHES = 1 << 16
# The most hashes one snapshot carries (the newest): within the router's message limit.
MAX_SNAPSHOT_HASHES = 1 << 19
# After the router says it does not serve PublishKVEvents (an older router): try again
# this much later, not every interval.
UNSUPPORTED_RETRY_S = 30.0
CALL_TIMEOUT_S = 5.0
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]


class KVPublisher:
    def __init__(self, router: str, worker_id: str, cluster_token: str = "",
                 router_ca: str = "", interval_s: float = PUBLISH_INTERVAL_S) -> None:
        if router_ca:
            with open(router_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.aio.secure_channel(router, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(router, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.RegistryStub(self.channel)
        self.worker_id = worker_id
        self.token = cluster_token
        self.interval_s = interval_s
        self.epoch = random.getrandbits(63) + 1
        self.mirror = KVMirror()
        # the events themselves: each is built into the batch message once, when it leaves
        self.pending: list[KVBlocksEvent] = []
        self._pending_hashes = 0
        self.need_snapshot = True  # the router has seen nothing of this epoch
        self._wake = asyncio.Event()
        self._next_at = 0.0  # loop time before which no batch leaves
        self._late: asyncio.TimerHandle | None = None  # the lone event's send
        # counters (worker /metrics, through ServingCounters)
        self.batches = 0
        self.snapshots = 0
        self.dropped = 0  # pending events dropped for a snapshot

    # -- the bridge's side -------------------------------------------------------------

    def add(self, ev: KVEventsEvent | KVSnapshotEvent) -> None:
        if isinstance(ev, KVSnapshotEvent):
            self.mirror.replace(ev)
            self._drop_pending()
        else:
            self.mirror.apply(ev)
            if not self.need_snapshot:  # a snapshot will carry them anyway
                self.pending.extend(ev.items)
                self._pending_hashes += sum(len(item.hashes) for item in ev.items)
                if self._pending_hashes > MAX_PENDING_HASHES:
                    self._drop_pending()
        self._ready()

    def _ready(self) -> None:
        """Something waits: send it now when the interval has passed (this wake-up carries
        it), else make sure a timer sends it an interval after it could have left, in case no
        other event comes first."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_at:
            self._wake.set()
        elif self._late is None:
            self._late = loop.call_at(self._next_at + self.interval_s, self._wake.set)

    def _drop_pending(self) -> None:
        self.dropped += len(self.pending)
        self.pending.clear()
        self._pending_hashes = 0
        self.need_snapshot = True

    # -- sending -----------------------------------------------------------------------

    def batch(self) -> worker_pb2.KVEventBatch | None:
        """What to send now (None: nothing). Takes the pending events."""
        if not self.need_snapshot and not self.pending:
            return None
        out = worker_pb2.KVEventBatch(worker_id=self.worker_id, cluster_token=self.token,
                                      epoch=self.epoch)
        if self.need_snapshot:
            out.snapshot.seq = self.mirror.seq
            out.snapshot.block_hashes.extend(self.mirror.snapshot(MAX_SNAPSHOT_HASHES))
            self.need_snapshot = False
            self.snapshots += 1
        else:
            add = out.events.add
            for item in self.pending:
                add(seq=item.seq, removed=item.removed, block_hashes=item.hashes)
        self.pending = []
        self._pending_hashes = 0
        return out

    def answered(self, ack: worker_pb2.KVEventAck) -> None:
        if not ack.known or ack.resync:
            self._drop_pending()

    async def run(self) -> None:
        """Until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._late is not None:
                    self._late.cancel()
                    self._late = None
                if (left := self._next_at - loop.time()) > 0:  # a resync or retry, early
                    await asyncio.sleep(left)
                batch = self.batch()
                if batch is None:
                    continue
                # set before the call: events added while it is in flight wait their turn
                self._next_at = loop.time() + self.interval_s
                if wait := await self._send(batch):
                    self._next_at = loop.time() + wait
        finally:
            if self._late is not None:
                self._late.cancel()
                self._late = None

    async def _send(self, batch: worker_pb2.KVEventBatch) -> float:
        """Sends one batch; the extra wait before the next (0: none)."""
        try:
            ack = await self.stub.PublishKVEvents(batch, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            self._drop_pending()  # the router may have applied none or all of it
            self._wake.set()
            code = cast(grpc.aio.AioRpcError, e).code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the router takes no KV events; retrying in %.0f s",
                         UNSUPPORTED_RETRY_S)
                return UNSUPPORTED_RETRY_S
            log.debug("KV events not published (%s)", code.name)
            return 1.0
        self.batches += 1
        self.answered(ack)
        if not ack.known or ack.resync:
            self._wake.set()
            # not registered yet (the first batch can beat the Register call): soon again
            return 0.0 if ack.known else 0.5
        return 0.0

    async def close(self) -> None:
        await self.channel.close()
