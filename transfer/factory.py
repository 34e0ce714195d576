"""Picks the backend named by ``TransferConfig.backend``."""

from __future__ import annotations

from engine.kv_layout import KVLayout
from transfer.base import KVReceiver, KVSender
from transfer.types import TransferConfig


def make_sender(pool: object, layout: KVLayout, config: TransferConfig,
                name: str = "producer") -> KVSender:
    """``pool``: the engine's KV tensor [num_blocks, layers, 2, block_size, kv_heads, dim]."""
    if config.backend == "fake":
        from transfer.fake import FakeSender

        return FakeSender(pool, layout, config, name)
    from transfer.net_sender import NetSender

    return NetSender(pool, layout, config, name)


def make_receiver(pool: object, layout: KVLayout, config: TransferConfig,
                  name: str = "consumer") -> KVReceiver:
    if config.backend == "fake":
        from transfer.fake import FakeReceiver

        return FakeReceiver(pool, layout, config, name)
    from transfer.net_receiver import NetReceiver

    return NetReceiver(pool, layout, config, name)
