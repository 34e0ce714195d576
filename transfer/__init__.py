"""KV transfer between producer and consumer nodes (docs/architecture.md).

Start with ``make_sender`` / ``make_receiver``; the contract is in ``transfer.base``.
"""

from transfer.base import KVReceiver, KVSender
from transfer.factory import make_receiver, make_sender
from transfer.types import (
    Accounting,
    HandshakeError,
    TransferConfig,
    TransferError,
    TransferNotice,
    TransferStats,
    TransferStatus,
    TransferUpdate,
)

__all__ = ["Accounting", "HandshakeError", "KVReceiver", "KVSender", "TransferConfig",
           "TransferError", "TransferNotice", "TransferStats", "TransferStatus", "TransferUpdate",
           "make_receiver", "make_sender"]
