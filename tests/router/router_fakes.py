"""Scripted in-process workers and a router+client harness for the router tests.

A ``FakeWorker`` serves ``pdserve.v1.Worker`` on its own grpc.aio server, registers with the
router and heartbeats like a real one. What it streams is a script (an async generator
function) chosen per test; it records what the router sent it (requests, destinations,
aborts, cancelled streams) so tests can assert on both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import RouterServer

P, C, CO = common_pb2.ROLE_PRODUCER, common_pb2.ROLE_CONSUMER, common_pb2.ROLE_COLOCATED
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
ABORT, ERROR = common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR
TOKEN0 = 42
BLOCKS = [7, 8, 9]
KV_ADDR = "tcp://127.0.0.1:5999"

_TOKENIZER: Tokenizer | None = None


def load_tokenizer() -> Tokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer.from_source(resolve_model(None))
    return _TOKENIZER


def now() -> int:
    return time.time_ns()


# -- scripts -------------------------------------------------------------------------------

PrefillScript = Callable[["FakeWorker", worker_pb2.PrefillRequest, AsyncIterator[Any]],
                         AsyncIterator[worker_pb2.PrefillOutput]]
DecodeScript = Callable[["FakeWorker", worker_pb2.DecodeRequest],
                        AsyncIterator[worker_pb2.DecodeOutput]]


def token0(token_id: int = TOKEN0, finish: int = 0, stop_reason: str = "",
           cached_tokens: int = 0) -> worker_pb2.PrefillOutput:
    t = now()
    return worker_pb2.PrefillOutput(token0=worker_pb2.Token0(
        token_id=token_id, text="A", finish_reason=finish, stop_reason=stop_reason,  # type: ignore[arg-type]
        sampled_ns=t, received_ns=t - 1000, sent_ns=t + 1, cached_tokens=cached_tokens))


def transfer(ok: bool = True, error: str = "") -> worker_pb2.PrefillOutput:
    return worker_pb2.PrefillOutput(transfer=worker_pb2.TransferResult(ok=ok, error=error,
                                                                       kv_transfer_ms=1.5))


def reserved() -> worker_pb2.DecodeOutput:
    return worker_pb2.DecodeOutput(reserved=worker_pb2.Reserved(kv_address=KV_ADDR,
                                                                block_ids=BLOCKS))


def tokens(ids: list[int], text: str, finish: int = 0, **kw: Any) -> worker_pb2.DecodeOutput:
    return worker_pb2.DecodeOutput(tokens=worker_pb2.Tokens(
        token_ids=ids, text=text, finish_reason=finish, **kw))  # type: ignore[arg-type]


async def next_destination(w: FakeWorker, inputs: AsyncIterator[Any]) -> None:
    """The next destination; the holds before it (the reservation queued) are recorded."""
    while (msg := await inputs.__anext__()).WhichOneof("kind") == "queued":
        w.holds.append((time.monotonic(), msg.queued.consumer_id))
    w.destinations.append(msg.destination)


async def prefill_ok(w: FakeWorker, req: Any, inputs: AsyncIterator[Any]
                     ) -> AsyncIterator[worker_pb2.PrefillOutput]:
    """Token 0 at once (before any destination), transfer ok once the destination came."""
    yield token0()
    await next_destination(w, inputs)
    yield transfer()


async def prefill_hang_after_token0(w: FakeWorker, req: Any, inputs: AsyncIterator[Any]
                                    ) -> AsyncIterator[worker_pb2.PrefillOutput]:
    yield token0()
    await next_destination(w, inputs)
    await asyncio.sleep(3600)


async def decode_ok(w: FakeWorker, req: worker_pb2.DecodeRequest
                    ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    if req.colocated:
        yield tokens([TOKEN0], "A", first_step_ns=now())
    else:
        yield reserved()
        await asyncio.sleep(0.02)  # "KV landing"
        ready = now()  # and the handoff's stamps before the admission, in their order
        yield tokens([101, 102], "BC", notice_sent_ns=ready - 3_000, notice_seen_ns=ready - 2_000,
                     kv_done_ns=ready - 1_000, kv_ready_ns=ready, first_step_ns=now())
    yield tokens([103], "D", LENGTH)


async def decode_endless(w: FakeWorker, req: worker_pb2.DecodeRequest
                         ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    """One token a step (10 ms), never finishing: for a client that leaves mid-stream."""
    yield reserved()
    i = 0
    while True:
        i += 1
        await asyncio.sleep(0.01)
        yield tokens([i], f"<{i}>")


BURSTS, BURST = 5, 10  # decode_bursts: consumer tokens after token 0, bursts of one step each


async def decode_bursts(w: FakeWorker, req: worker_pb2.DecodeRequest
                        ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    """Tokens in bursts: each burst's tokens reach the worker's Outputs queue in one loop
    pass, and its batch (``batch_all``) carries all of them, as a service whose loop fell
    behind its engine sends several steps' tokens of one request together."""
    yield reserved()
    for b in range(BURSTS):
        await asyncio.sleep(0.05)  # the previous burst went out meanwhile
        for i in range(b * BURST + 1, (b + 1) * BURST + 1):
            yield tokens([i], f"<{i}>", LENGTH if i == BURSTS * BURST else 0)


def burst_text() -> str:
    """The whole text of a request served by ``decode_bursts`` (token 0 is "A")."""
    return "A" + "".join(f"<{i}>" for i in range(1, BURSTS * BURST + 1))


async def decode_hang_after_reserve(w: FakeWorker, req: worker_pb2.DecodeRequest
                                    ) -> AsyncIterator[worker_pb2.DecodeOutput]:
    yield reserved()
    await asyncio.sleep(3600)


# -- the fake worker -----------------------------------------------------------------------

# How a streaming handler learns that the router cancelled its call: usually CancelledError;
# when the cancel lands as the handler starts, grpc.aio closes the handler's generator
# instead (GeneratorExit at its first yield), as test_dispatch's token-0 test met at load.
CLIENT_GONE = (asyncio.CancelledError, GeneratorExit)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, role: int, *, prefill: PrefillScript = prefill_ok,
                 decode: DecodeScript = decode_ok, kv_fingerprint: str = "fp1",
                 max_model_len: int = 2048, model: str = "smollm2",
                 outputs: bool = False, start_delay_s: float = 0.0,
                 refuse_start: tuple[grpc.StatusCode, str] | None = None,
                 batch_all: bool = False, token0_delay_s: float = 0.0,
                 start_prefill: bool = True) -> None:
        """outputs: serve Outputs and StartDecode (the decode script's reservation and
        tokens go to the Outputs stream StartDecode names); start_delay_s: StartDecode
        answers that late, after its request's outputs went out; refuse_start: StartDecode
        answers with this status instead; batch_all: one batch carries every output waiting
        when it leaves (one request's several tokens in one batch, as a service whose loop
        fell behind its engine sends them); token0_delay_s: with outputs, a Prefill that
        names the Outputs stream gets its token 0 there this late (and not on its own
        stream, which goes on at once: its transfer result may overtake the token);
        start_prefill: with outputs, serve StartPrefill and PrefillControl (the prefill
        script's token 0 and result go to the Outputs stream, in order, and PrefillControl
        feeds its inputs); False: they answer UNIMPLEMENTED, as an older producer."""
        self.worker_id, self.role = worker_id, role
        self.prefill_script, self.decode_script = prefill, decode
        self.kv_fingerprint, self.max_model_len, self.model = kv_fingerprint, max_model_len, model
        self.prefill_requests: list[worker_pb2.PrefillRequest] = []
        self.decode_requests: list[worker_pb2.DecodeRequest] = []
        self.destinations: list[worker_pb2.KVDestination] = []
        self.holds: list[tuple[float, str]] = []  # (monotonic, consumer id) of each hold
        self.aborts: list[str] = []
        self.lose_aborts = 0  # Aborts to answer without ending anything (lost_aborts)
        self.lost_aborts: list[str] = []
        self.cancelled: list[str] = []  # streams the router cancelled
        self.inputs_closed: list[str] = []  # Prefill streams the router half-closed
        self.abort_event = asyncio.Event()
        self.load = common_pb2.WorkerLoad(kv_blocks_free=100, kv_blocks_total=100)
        self.heartbeating = True
        self.outputs, self.start_delay_s = outputs, start_delay_s
        self.refuse_start, self.batch_all = refuse_start, batch_all
        self.token0_delay_s = token0_delay_s
        self.start_prefill = start_prefill
        self.prefill_inputs: dict[str, asyncio.Queue[Any]] = {}  # StartPrefill's requests
        self.subscribers: dict[str, asyncio.Queue[Any]] = {}
        self.started: dict[str, asyncio.Task[None]] = {}  # StartDecode's requests
        self.seq = 0
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._hb: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, router_address: str, token: str = "") -> None:
        self._server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self._channel = grpc.aio.insecure_channel(router_address)
        self.registry = worker_pb2_grpc.RegistryStub(self._channel)
        resp = await self.register(token)
        self._hb = asyncio.get_running_loop().create_task(
            self._heartbeat(resp.heartbeat_interval_s, token))

    async def register(self, token: str = "", **overrides: Any) -> worker_pb2.RegisterResponse:
        fields: dict[str, Any] = dict(
            worker_id=self.worker_id, role=self.role, address=self.address,
            kv_address=KV_ADDR if self.role == C else "", model=self.model,
            kv_fingerprint=self.kv_fingerprint, max_model_len=self.max_model_len,
            load=self.load, cluster_token=token)
        fields.update(overrides)
        return await self.registry.Register(worker_pb2.RegisterRequest(**fields))

    async def _heartbeat(self, interval: float, token: str) -> None:
        while True:
            await asyncio.sleep(interval)
            if not self.heartbeating:
                continue
            with contextlib.suppress(grpc.aio.AioRpcError):
                r = await self.registry.Heartbeat(worker_pb2.HeartbeatRequest(
                    worker_id=self.worker_id, load=self.load, cluster_token=token))
                if not r.known:
                    await self.register(token)

    def stop_heartbeats(self) -> None:
        """As a worker that deregistered (done) and exits: none follows, not even one that
        was on its way (its answer, unknown, would register the worker again)."""
        self.heartbeating = False
        if self._hb is not None:
            self._hb.cancel()

    async def kill(self) -> None:
        """Like a crashed process: the server goes away, streams break, heartbeats stop."""
        self.heartbeating = False
        for task in self.started.values():
            task.cancel()
        if self._server is not None:
            await self._server.stop(None)

    async def stop(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
        await self.kill()
        await self._channel.close()

    # -- Worker service --------------------------------------------------------------------

    async def Prefill(self, request_iterator: Any, context: Any
                      ) -> AsyncIterator[worker_pb2.PrefillOutput]:
        inputs = request_iterator.__aiter__()
        first = await inputs.__anext__()
        req = first.request
        self.prefill_requests.append(req)
        routed = False
        try:
            async for out in self.prefill_script(self, req, self._watch_close(req, inputs)):
                kind = out.WhichOneof("kind")
                if (self.outputs and req.subscriber_id and kind == "token0"
                        and not out.token0.finish_reason
                        and (q := self.subscribers.get(req.subscriber_id)) is not None):
                    out.token0.request_id = req.request_id
                    asyncio.get_running_loop().call_later(
                        self.token0_delay_s, self._queue_batch, q,
                        worker_pb2.OutputBatch(token0s=[out.token0]))
                    routed = True
                    continue
                if kind == "transfer":
                    out.transfer.token0_routed = routed
                yield out
        except CLIENT_GONE:
            self.cancelled.append(req.request_id)
            raise

    def _queue_batch(self, q: asyncio.Queue[Any], batch: worker_pb2.OutputBatch) -> None:
        self.seq += 1
        batch.seq = self.seq
        q.put_nowait(batch)

    async def _watch_close(self, req: Any, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for msg in inputs:
            yield msg
        self.inputs_closed.append(req.request_id)

    async def Decode(self, request: worker_pb2.DecodeRequest, context: Any
                     ) -> AsyncIterator[worker_pb2.DecodeOutput]:
        self.decode_requests.append(request)
        try:
            async for out in self.decode_script(self, request):
                yield out
        except CLIENT_GONE:
            self.cancelled.append(request.request_id)
            raise

    async def StartDecode(self, request: worker_pb2.DecodeRequest, context: Any
                          ) -> worker_pb2.DecodeStarted:
        if not self.outputs:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no StartDecode here")
        self.decode_requests.append(request)
        if self.refuse_start is not None:
            await context.abort(*self.refuse_start)
        q = self.subscribers.get(request.subscriber_id)
        if q is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "subscriber_id: not open")
        rid = request.request_id

        async def feed() -> None:
            async for out in self.decode_script(self, request):
                if out.WhichOneof("kind") == "tokens":
                    out.tokens.request_id = rid
                    batch = worker_pb2.OutputBatch(tokens=[out.tokens])
                else:
                    out.reserved.request_id = rid
                    batch = worker_pb2.OutputBatch(reserved=[out.reserved])
                self.seq += 1
                batch.seq = self.seq
                q.put_nowait(batch)

        task = asyncio.get_running_loop().create_task(feed())
        # Told by the task's end, not by an except clause in feed: an Abort that comes
        # before the task first ran cancels a coroutine whose body never starts.
        task.add_done_callback(lambda t: t.cancelled() and self.cancelled.append(rid))
        self.started[rid] = task
        await asyncio.sleep(self.start_delay_s)
        return worker_pb2.DecodeStarted()

    async def StartPrefill(self, request: worker_pb2.PrefillRequest, context: Any
                           ) -> worker_pb2.PrefillStarted:
        if not (self.outputs and self.start_prefill):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no StartPrefill here")
        self.prefill_requests.append(request)
        q = self.subscribers.get(request.subscriber_id)
        if q is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "subscriber_id: not open")
        rid = request.request_id
        inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.prefill_inputs[rid] = inputs

        async def fed() -> AsyncIterator[Any]:
            while True:
                yield await inputs.get()

        async def feed() -> None:
            try:
                async for out in self.prefill_script(self, request, fed()):
                    if out.WhichOneof("kind") == "token0":
                        out.token0.request_id = rid
                        batch = worker_pb2.OutputBatch(token0s=[out.token0])
                        if out.token0.finish_reason:
                            self._queue_batch(q, batch)
                            return
                        if self.token0_delay_s:
                            await asyncio.sleep(self.token0_delay_s)
                    else:
                        out.transfer.request_id = rid
                        batch = worker_pb2.OutputBatch(transfers=[out.transfer])
                    self._queue_batch(q, batch)
            finally:
                self.prefill_inputs.pop(rid, None)

        task = asyncio.get_running_loop().create_task(feed())
        task.add_done_callback(lambda t: t.cancelled() and self.cancelled.append(rid))
        self.started[rid] = task
        await asyncio.sleep(self.start_delay_s)
        return worker_pb2.PrefillStarted()

    async def PrefillControl(self, request: worker_pb2.PrefillControlRequest, context: Any
                             ) -> worker_pb2.PrefillControlResponse:
        if not (self.outputs and self.start_prefill):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no PrefillControl here")
        inputs = self.prefill_inputs.get(request.request_id)
        if inputs is None:
            return worker_pb2.PrefillControlResponse(known=False)
        msg = worker_pb2.PrefillInput()
        kind = request.WhichOneof("kind")
        getattr(msg, str(kind)).CopyFrom(getattr(request, str(kind)))
        inputs.put_nowait(msg)
        return worker_pb2.PrefillControlResponse(known=True)

    async def Outputs(self, request: worker_pb2.OutputsRequest, context: Any
                      ) -> AsyncIterator[worker_pb2.OutputBatch]:
        if not self.outputs:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Outputs here")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.subscribers[request.subscriber_id] = q
        yield worker_pb2.OutputBatch(seq=0)
        while True:
            batch = await q.get()
            if isinstance(batch, str):  # break_outputs: the stream fails
                await context.abort(grpc.StatusCode.UNAVAILABLE, batch)
            while self.batch_all and not q.empty():
                more = q.get_nowait()
                batch.tokens.extend(more.tokens)
                batch.reserved.extend(more.reserved)
                batch.token0s.extend(more.token0s)
                batch.transfers.extend(more.transfers)
                batch.seq = more.seq
            yield batch

    def break_outputs(self, why: str = "outputs broke") -> None:
        """Every open Outputs stream fails (UNAVAILABLE), after what it has queued."""
        for q in self.subscribers.values():
            q.put_nowait(why)

    async def Abort(self, request: worker_pb2.WorkerAbortRequest, context: Any
                    ) -> worker_pb2.WorkerAbortResponse:
        if self.lose_aborts:  # as if it overtook the request's StartDecode: nothing to end
            self.lose_aborts -= 1
            self.lost_aborts.append(request.request_id)
            return worker_pb2.WorkerAbortResponse(ok=False)
        self.aborts.append(request.request_id)
        self.abort_event.set()
        if (task := self.started.pop(request.request_id, None)) is not None:
            task.cancel()
        return worker_pb2.WorkerAbortResponse(ok=True)


# -- router + client harness ---------------------------------------------------------------

def fast_config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = dict(grpc_port=0, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
                                abort_timeout_s=1.0, token0_timeout_s=10.0, token_timeout_s=10.0)
    base.update(kw)
    return RouterConfig(**base)


class Cluster:
    def __init__(self, **config: Any) -> None:
        self.config = fast_config(**config)
        self.server = RouterServer(self.config, tokenizer=load_tokenizer())
        self.workers: list[FakeWorker] = []

    async def __aenter__(self) -> Cluster:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.router = router_pb2_grpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.workers:
            await w.stop()
        await self.channel.close()
        await self.server.stop(grace=0.1)

    async def add(self, worker_id: str, role: int, **kw: Any) -> FakeWorker:
        token = kw.pop("token", self.config.cluster_token)
        w = FakeWorker(worker_id, role, **kw)
        self.workers.append(w)
        await w.start(self.server.address, token)
        return w

    async def pd(self, **kw: Any) -> tuple[FakeWorker, FakeWorker]:
        p = await self.add("p0", P, prefill=kw.pop("prefill", prefill_ok))
        c = await self.add("c0", C, decode=kw.pop("decode", decode_ok))
        return p, c

    async def generate(self, **kw: Any) -> list[router_pb2.GenerateResponse]:
        return [r async for r in self.router.Generate(request(**kw))]


def request(prompt: str = "Hello there", **sampling: Any) -> router_pb2.GenerateRequest:
    rid = sampling.pop("request_id", "")
    return router_pb2.GenerateRequest(request_id=rid, prompt=prompt,
                                      sampling=common_pb2.SamplingParams(**sampling))


def run(coro: Any, timeout: float = 20.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def read_all(call: Any) -> list[router_pb2.GenerateResponse]:
    """The rest of a stream, with read() (grpc.aio forbids mixing it with iteration)."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
