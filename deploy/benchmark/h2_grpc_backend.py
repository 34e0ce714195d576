"""The router's gRPC ``Generate`` over a hand-framed HTTP/2 client (``h2_connection``): the
same requests and records as ``GrpcBackend``, at a fraction of grpcio's client CPU per
streamed token, so a load generator on the serving host does not take the cores the
router's frontends need. Cleartext only (no ``--router-ca``)."""

from __future__ import annotations

import asyncio
import time

import grpc
from pdserve.v1 import router_pb2

from deploy.benchmark.backend import Backend, SamplingChoice
from deploy.benchmark.grpc_backend import finish_record, generate_request, take_response
from deploy.benchmark.h2_connection import CallEnded, H2Connection
from deploy.benchmark.record import RequestRecord
from deploy.benchmark.workload import RequestSpec
from deploy.router_client import RouterError, auth_metadata
from router.grpc_stream.status import GENERATE_PATH

# grpc's status names by number (the trailers carry the number)
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class H2GrpcBackend(Backend):
    name = "grpc-h2"

    def __init__(self, address: str, api_key: str = "", router_ca: str = "") -> None:
        if router_ca:
            raise RouterError("the hand-framed gRPC client speaks cleartext only: use the "
                              "grpc backend with --router-ca")
        self.address = address
        self.metadata = auth_metadata(api_key)
        self.conn: H2Connection | None = None

    async def open(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            _, self.conn = await asyncio.get_running_loop().create_connection(
                lambda: H2Connection(self.address), host.strip("[]"), int(port))
        except (OSError, ValueError) as e:
            raise RouterError(f"{self.address}: {e}") from None

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    async def send(self, spec: RequestSpec, rec: RequestRecord,
                   sampling: SamplingChoice) -> None:
        assert self.conn is not None
        counted = 0

        def on_message(data: bytes) -> None:
            nonlocal counted
            counted = take_response(rec, router_pb2.GenerateResponse.FromString(data),
                                    counted)

        metadata = (*self.metadata,
                    ("grpc-timeout", f"{max(1, int(sampling.timeout_s * 1000))}m"))
        message = generate_request(spec, sampling).SerializeToString()
        rec.start = time.perf_counter()
        call = None
        try:
            call = await self.conn.call(GENERATE_PATH, message, metadata, on_message)
            # the server's deadline ends the call first; this one only if the server is gone
            code, details = await asyncio.wait_for(asyncio.shield(call.done),
                                                   sampling.timeout_s + 5.0)
            if code:
                name = STATUS_NAMES.get(code, str(code))
                rec.error = f"{name}: {details}"
        except CallEnded as e:
            rec.error = f"{e.code}: {e.details}"
        except TimeoutError:
            rec.error = "DEADLINE_EXCEEDED: no end from the server"
            if call is not None:
                self.conn.cancel(call, "client timeout")
                if call.done.done():  # its failure is this record's error: mark it seen
                    call.done.exception()
        finish_record(rec, counted)
