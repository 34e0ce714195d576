"""A consumer's KV receiver with a cluster token refuses producers that lack it."""

from __future__ import annotations

import pytest
import torch
from xfer_helpers import LAYOUT, cfg

from transfer import HandshakeError, make_receiver, make_sender


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYOUT.num_blocks, *LAYOUT.block_shape)
    return (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("backend", ["fake", "ucx"])
@pytest.mark.parametrize("sender_token", ["", "wrong"])
def test_handshake_without_the_cluster_token_is_refused(backend: str, sender_token: str) -> None:
    src, dst = _pools()
    rx = make_receiver(dst, LAYOUT, cfg(backend, cluster_token="s3cret"))
    tx = make_sender(src, LAYOUT, cfg(backend, cluster_token=sender_token))
    with rx, tx:
        with pytest.raises(HandshakeError, match="cluster token"):
            tx.connect(rx.address, timeout=10)
        assert tx.accounting().peers == 0
        assert rx.accounting().peers == 0


@pytest.mark.parametrize("backend", ["fake", "ucx"])
def test_handshake_with_the_cluster_token_connects(backend: str) -> None:
    src, dst = _pools()
    rx = make_receiver(dst, LAYOUT, cfg(backend, cluster_token="s3cret"))
    tx = make_sender(src, LAYOUT, cfg(backend, cluster_token="s3cret"))
    with rx, tx:
        tx.connect(rx.address, timeout=10)
        assert tx.accounting().peers == 1
        assert "s3cret" not in repr(tx.config)  # secrets stay out of logs
