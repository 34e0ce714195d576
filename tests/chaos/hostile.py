"""Hostile input for the chaos driver: junk frames at a consumer's KV port, sent from a
stranger's socket (no handshake, no token)."""

from __future__ import annotations

import os
import random
import re
import time

import msgpack
import zmq

from deploy.cluster import LocalCluster


def kv_address(cluster: LocalCluster, name: str) -> str:
    """A consumer's KV port, from the last ready line it logged (a restart logs a new one)."""
    assert cluster.log_dir
    with open(os.path.join(cluster.log_dir, f"{name}.log"), errors="replace") as f:
        found = re.findall(r"'kv_address': '([^']+)'", f.read())
    if not found:
        raise RuntimeError(f"{name}: no kv_address in its log yet")
    return str(found[-1])


def hostile_frames(address: str, rng: random.Random) -> str:
    """Sends junk to a KV port from a stranger's socket; returns what was sent."""
    frames = [b"\xc1", rng.randbytes(rng.randrange(1, 512)),
              msgpack.packb(["push", "x"])[:-1],  # truncated
              msgpack.packb({"kind": 7, "blocks": "all"}),  # mistyped
              msgpack.packb(["hello", -1, [10 ** 12], None]),  # a kind with bad fields
              b"\x00" * (4 << 20)]  # oversized
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    try:
        sock.connect(address)
        for fr in frames:
            try:
                sock.send_multipart([fr] if rng.random() < 0.7 else [fr, fr])
            except zmq.Again:
                break
        time.sleep(0.05)
    finally:
        sock.close()
        ctx.term()
    return f"{len(frames)} frames to {address}"
