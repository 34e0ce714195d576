"""gRPC over HTTP/2, the wire words the stream door needs beyond h2: status trailers, the
percent-encoded ``grpc-message``, ``grpc-timeout`` and the 5-byte message prefix."""

from __future__ import annotations

import grpc

GENERATE_PATH = "/pdserve.v1.Router/Generate"
RESPONSE_HEADERS = ((":status", "200"), ("content-type", "application/grpc"))
# grpc-timeout's units (the gRPC HTTP/2 protocol): hours to nanoseconds
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def percent_encode(message: str) -> str:
    """``grpc-message``'s encoding: UTF-8, then every byte outside printable ASCII and
    ``%`` itself as ``%XX``."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}"
                   for b in message.encode())


def parse_timeout(value: str) -> float:
    """``grpc-timeout`` in seconds; ValueError naming the header if it is malformed (at most
    8 digits and one unit letter)."""
    digits, unit = value[:-1], value[-1:]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"grpc-timeout: not <1-8 digits><H|M|S|m|u|n>, got {value!r}")
    return int(digits) * _UNITS[unit]


def status_headers(code: grpc.StatusCode, message: str,
                   extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
    """The trailers that end a call with ``code``."""
    out = [("grpc-status", str(code.value[0]))]
    if message:
        out.append(("grpc-message", percent_encode(message)))
    out.extend(extra)
    return out


def prefixed(message: bytes) -> bytes:
    """A gRPC length-prefixed message: not compressed (0), its length (32 bits), the bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message
