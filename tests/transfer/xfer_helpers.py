"""Helpers shared by the transfer tests: a small layout, pools, a connected pair per backend."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from engine.kv_layout import KVLayout
from transfer import TransferConfig, make_receiver, make_sender

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _nixl_skip() -> str | None:
    try:
        from transfer.nixl_plane import available
    except ImportError as e:
        return f"nixl-cu12 not importable: {e}"
    ok, why = available()
    return None if ok else why


NIXL_SKIP = _nixl_skip()
BACKENDS = ["fake", "ucx", "ipc",
            pytest.param("nixl", marks=pytest.mark.skipif(NIXL_SKIP is not None,
                                                          reason=str(NIXL_SKIP)))]
NET_BACKENDS = BACKENDS[1:]

LAYOUT = KVLayout("tiny", "bfloat16", 16, 4, 2, 64, 64)  # 32 KiB blocks, 2 MiB pool


def pool(fill: float | None = None, layout: KVLayout = LAYOUT) -> torch.Tensor:
    shape = (layout.num_blocks, *layout.block_shape)
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.bfloat16)
    return torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)


def cfg(backend: str, **kw: Any) -> TransferConfig:
    base: dict[str, Any] = dict(backend=backend, peer_timeout_s=2.0, heartbeat_interval_s=0.25,
                                transfer_timeout_s=30.0)
    return TransferConfig(**{**base, **kw})


class Pair:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.src, self.dst = pool(), pool(fill=-1.0)
        self.rx = make_receiver(self.dst, LAYOUT, cfg(backend))
        self.tx = make_sender(self.src, LAYOUT, cfg(backend))
        self.tx.connect(self.rx.address, timeout=10)
        self.addr = self.rx.address

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def until_terminal(side: Any, rid: str, timeout: float = 10.0) -> Any:
    """The update a sender or receiver (or a TP rank side) reports for rid, polling it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for u in side.poll():
            if u.request_id == rid:
                return u
        time.sleep(0.001)
    raise AssertionError(f"{rid}: not terminal")

