"""An SSE stream as what ``DirectWrite`` drives: a decoding request's text chunks written
from the pass over the worker's batch, as the gRPC door's are.

``DirectWrite`` (router/requests/direct_write.py) starts a stream's write where the tokens
were demultiplexed and finishes it from the write's completion, so no handler task and no
generator chain wakes per token. For gRPC the write is ``context.write(response)``; here
``SseStream.write(response)`` encodes the response as the stream's handler does (the same
builder, so text, tool parsing and logprobs stay in order) and writes it with aiohttp; the
write counts as in flight until the loop's next pass, so tokens of the same batch wait and
merge as they do behind a gRPC write.

``write_now`` is the steady state's shorter way: the chunk, framed for HTTP/1.1 chunked
transfer here (size line, data, CRLF, one ``bytes``), goes straight to the connection's
transport, with no coroutine of aiohttp's write per chunk (three nested ones) and no
wake-up of its own; ``DirectWrite`` holds every stream written so in one pass until the
next pass, with one callback for all of them. It applies only where aiohttp's own write
would send the same bytes at once: the response's headers out, chunked, not compressed,
no declared length, and the transport's buffer under aiohttp's drain mark (past it the
chunk takes aiohttp's write, which waits for the buffer to drain: a slow client's
backpressure is unchanged).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from pdserve.v1 import router_pb2

from router.http.openai_response import ResponseBuilder
from router.http.sse_template import sse

# aiohttp's StreamWriter drains (waits for the transport) past this many buffered bytes
DRAIN_MARK = 0x10000


class SseStream:
    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.out: web.StreamResponse | None = None  # set once the response is prepared

    def chunk(self, resp: router_pb2.GenerateResponse) -> bytes | None:
        """``resp`` taken by the builder, as the event to send (None: nothing to send)."""
        data = self.builder.text_sse(resp)  # the steady state: text only, pre-encoded
        if data is None and (chunk := self.builder.add(resp)) is not None:
            data = sse(chunk)
        return data

    def write_now(self, resp: router_pb2.GenerateResponse) -> bool:
        """Writes ``resp``'s chunk to the transport now if nothing of aiohttp's would differ
        (see the module's text); False: nothing was taken, ``write`` is the way."""
        out = self.out
        w = out._payload_writer if out is not None else None  # noqa: SLF001
        if (not isinstance(w, StreamWriter) or not w.chunked or w._compress is not None  # noqa: SLF001
                or w._headers_buf is not None or w.length is not None  # noqa: SLF001
                or w._on_chunk_sent is not None or w.on_body_write is not None):  # noqa: SLF001
            return False
        t = w.transport
        if t is None or t.is_closing() or t.get_write_buffer_size() > DRAIN_MARK:
            return False
        data = self.chunk(resp)
        if data:
            frame = b"%x\r\n%b\r\n" % (len(data), data)
            w.output_size += len(frame)
            t.write(frame)
        return True

    async def write(self, resp: router_pb2.GenerateResponse) -> None:
        """``DirectWrite``'s write: the stream is prepared before the handler first waits
        for a response, and only then can a direct write start."""
        if self.out is None:
            raise RuntimeError("a direct write before the SSE stream was prepared")
        data = self.chunk(resp)
        if data is not None:
            await self.out.write(data)
        # aiohttp's write is done once the bytes are in the transport's buffer: without
        # this the writer would be idle again within the same pass over the batch, and a
        # batch's further tokens of this request would each leave as a chunk of their own.
        # Busy until the next loop pass, they queue behind it and leave merged.
        await asyncio.sleep(0)
