"""The router's gRPC API: ``Generate`` with prompt token ids, server timing from the end."""

from __future__ import annotations

import time

import grpc
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec
from deploy.router_client import RouterError, aio_channel, auth_metadata, error_line

FAILED_REASONS = {common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT}
# Long prompts and many concurrent streams: lift gRPC's default message limits. Each
# backend its own connection: without a local subchannel pool, every channel of a process to
# one address shares one TCP connection, so several backends (``--connections``, the CPU
# bench's ``--connections-per-client``) would still reach only one of a router's frontends.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.use_local_subchannel_pool", 1)]


def _delta_ms(later_ns: int, earlier_ns: int) -> float | None:
    return (later_ns - earlier_ns) / 1e6 if later_ns and earlier_ns else None


def apply_timing(rec: RequestRecord, t: router_pb2.ServerTiming) -> None:
    rec.hold_ms = _delta_ms(t.router_token0_sent_ns, t.producer_token0_sampled_ns)
    rec.hold_producer_ms = _delta_ms(t.producer_token0_sent_ns, t.producer_token0_sampled_ns)
    # of which the engine process's own part, up to its emit (the rest: the hop to the
    # gRPC process and its loop reaching the message)
    rec.hold_engine_ms = _delta_ms(t.producer_token0_emitted_ns, t.producer_token0_sampled_ns)
    # the rest of the hold, in three parts when token 0 came on the producer's Outputs
    # stream: its writer's wait, the wire (and the router's read), the router's own part
    rec.hold_writer_ms = _delta_ms(t.producer_token0_taken_ns, t.producer_token0_sent_ns)
    rec.hold_wire_ms = _delta_ms(t.router_token0_read_ns,
                                 t.producer_token0_taken_ns or t.producer_token0_sent_ns)
    rec.hold_router_ms = _delta_ms(t.router_token0_sent_ns, t.router_token0_read_ns)
    rec.token0_sampled_ns = t.producer_token0_sampled_ns
    rec.prefill_ms = _delta_ms(t.producer_token0_sampled_ns, t.producer_received_ns)
    # 0 means "not applicable" (colocated, or token 0 ended the request at the producer).
    rec.kv_transfer_ms = t.kv_transfer_ms if t.kv_transfer_ms > 0 else None
    # the handoff (record.py); negative where a busy router sent token 0 after the KV landed
    rec.kv_ready_ms = _delta_ms(t.consumer_kv_ready_ns, t.router_token0_sent_ns)
    rec.first_step_wait_ms = _delta_ms(t.consumer_first_step_ns, t.consumer_kv_ready_ns)
    # kv_ready_ms in its parts (record.py), only where every stamp came: parts of one
    # request's stamps add up to kv_ready_ms, and a missing one would shift its time into
    # a neighbour
    marks = (t.router_token0_sent_ns, t.producer_notice_sent_ns, t.consumer_notice_seen_ns,
             t.consumer_kv_done_ns, t.consumer_kv_ready_ns)
    if all(marks):
        rec.notice_sent_ms, rec.notice_wire_ms, rec.kv_copy_ms, rec.kv_poll_ms = (
            (b - a) / 1e6 for a, b in zip(marks, marks[1:], strict=False))
    if t.router_destination_sent_ns and t.producer_token0_sampled_ns:
        rec.dest_after_token0_ms = (t.router_destination_sent_ns
                                    - t.producer_token0_sampled_ns) / 1e6


class GrpcBackend(Backend):
    name = "grpc"

    def __init__(self, address: str, api_key: str = "", router_ca: str = "",
                 status_address: str | None = None) -> None:
        self.address = address
        # the router's port for ClusterStatus (its hand-framed door serves Generate only)
        self.status_address = status_address
        self.router_ca = router_ca
        self.metadata = auth_metadata(api_key)
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None

    async def open(self) -> None:
        self._channel = aio_channel(self.address, self.router_ca, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def workers(self) -> int:
        assert self._stub is not None
        address, stub, channel = self.address, self._stub, None
        if self.status_address and self.status_address != self.address:
            address = self.status_address
            channel = aio_channel(address, self.router_ca, options=CHANNEL_OPTIONS)
            stub = router_pb2_grpc.RouterStub(channel)
        try:
            st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10,
                                          metadata=self.metadata)
        except grpc.aio.AioRpcError as e:  # the first call: a wrong key or address ends here
            raise RouterError(error_line(address, e)) from None
        finally:
            if channel is not None:
                await channel.close()
        return sum(1 for w in st.workers if w.healthy)

    async def send(self, spec: RequestSpec, rec: RequestRecord,
                   sampling: SamplingChoice) -> None:
        assert self._stub is not None
        req = generate_request(spec, sampling)
        counted = 0
        rec.start = time.perf_counter()
        try:
            async for msg in self._stub.Generate(req, timeout=sampling.timeout_s,
                                                 metadata=self.metadata):
                counted = take_response(rec, msg, counted)
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details() or ''}"
        finish_record(rec, counted)


def generate_request(spec: RequestSpec, sampling: SamplingChoice) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt_token_ids=router_pb2.TokenIds(ids=spec.prompt_ids),
        sampling=common_pb2.SamplingParams(max_tokens=spec.output_len,
                                           temperature=sampling.temperature,
                                           ignore_eos=sampling.ignore_eos))


def take_response(rec: RequestRecord, msg: router_pb2.GenerateResponse, counted: int) -> int:
    """One response message into the record (arrival time, finish, usage, timing); returns
    the tokens counted so far."""
    if msg.token_ids:
        rec.arrivals.append((time.perf_counter(), len(msg.token_ids)))
        counted += len(msg.token_ids)
    if msg.finish_reason:
        rec.finish_reason = common_pb2.FinishReason.Name(msg.finish_reason)
        if msg.finish_reason in FAILED_REASONS:
            rec.error = f"{rec.finish_reason}: {msg.error or 'no details'}"
        if msg.HasField("usage"):
            rec.prompt_len = msg.usage.prompt_tokens or rec.prompt_len
            counted = msg.usage.completion_tokens or counted
            rec.cached_tokens = msg.usage.cached_tokens
        if msg.HasField("timing"):
            apply_timing(rec, msg.timing)
    return counted


def finish_record(rec: RequestRecord, counted: int) -> None:
    rec.end = time.perf_counter()
    rec.output_tokens = counted
    if not rec.error and not rec.finish_reason:
        rec.error = "stream ended without a finish reason"
    rec.success = not rec.error
