"""The router's second gRPC listener (``--grpc-stream-port``): ``pdserve.v1.Router/Generate``
served on an asyncio transport with each response message framed by hand.

The ``h2`` package does what happens per connection and per request (preface, SETTINGS,
PING, GOAWAY, RST_STREAM, WINDOW_UPDATE, HPACK); a response message is one DATA frame (or
several, at the peer's MAX_FRAME_SIZE) written straight to the transport, charged to the
peer's windows that h2 keeps. The request path behind it is the grpc.aio door's
(``Frontend.generate`` with a ``DirectWrite``): the same validation, admission, dispatch
and refusals. bench/RESULTS.md has the per-token CPU against grpc.aio's write.
"""
