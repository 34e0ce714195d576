"""Pure pieces: block runs, config validation, the handshake check, the notice wire form."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from xfer_helpers import LAYOUT, cfg

from engine.kv_layout import KVLayout
from transfer import (
    HandshakeError,
    TransferConfig,
    TransferNotice,
    handshake,
    make_receiver,
    make_sender,
)
from transfer.io_loop import IOLoop
from transfer.pool import BlockRun, KVPool, block_runs


def test_block_runs_merge_only_when_both_sides_adjacent() -> None:
    assert block_runs([1, 2, 3, 7, 8], [10, 11, 12, 13, 14]) == [
        BlockRun(1, 10, 3), BlockRun(7, 13, 2)]
    assert block_runs([1, 2], [5, 9]) == [BlockRun(1, 5, 1), BlockRun(2, 9, 1)]
    assert block_runs([], []) == []


def test_config_validates_with_flag_names() -> None:
    assert TransferConfig().peer_timeout_s <= 10.0
    with pytest.raises(ValueError, match="peer_timeout_s"):
        TransferConfig(peer_timeout_s=30)
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(backend="carrier-pigeon")
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        TransferConfig(heartbeat_interval_s=4, peer_timeout_s=5)


def test_pool_must_match_layout() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVPool(torch.zeros((LAYOUT.num_blocks, *LAYOUT.block_shape)), LAYOUT)
    with pytest.raises(ValueError, match="shape"):
        KVPool(torch.zeros((3, 3), dtype=torch.bfloat16), LAYOUT)


def test_notice_round_trips_through_msgpack_form() -> None:
    n = TransferNotice("r", 5, True, 17, seed=None, logprobs=((5, -0.1),))
    assert TransferNotice.from_wire(n.to_wire()) == n


def test_handshake_names_every_differing_field() -> None:
    other = dataclasses.replace(LAYOUT, dtype="float16", head_dim=128)
    with pytest.raises(HandshakeError, match=r"dtype: 'bfloat16' != 'float16'; head_dim: 64"):
        handshake.check(LAYOUT, "ucx", handshake.hello(other, "ucx", b""), "peer")
    with pytest.raises(HandshakeError, match="protocol version"):
        handshake.check(LAYOUT, "ucx", {"version": 0}, "peer")


@pytest.mark.parametrize("backend", ["fake", "ucx"])
def test_connect_to_mismatched_layout_fails_clearly(backend: str) -> None:
    other = KVLayout("other-model", "bfloat16", 32, 4, 2, 64, LAYOUT.num_blocks // 2)
    dst = torch.zeros((other.num_blocks, *other.block_shape), dtype=torch.bfloat16)
    src = torch.zeros((LAYOUT.num_blocks, *LAYOUT.block_shape), dtype=torch.bfloat16)
    rx, tx = make_receiver(dst, other, cfg(backend)), make_sender(src, LAYOUT, cfg(backend))
    with rx, tx:
        with pytest.raises(HandshakeError) as e:
            tx.connect(rx.address, timeout=10)
        msg = str(e.value)
        assert "KV layout mismatch" in msg and "model: " in msg and "other-model" in msg
        assert "block_size: " in msg and "head_dim" not in msg
        assert tx.accounting().peers == 0


def test_a_turns_messages_to_one_peer_travel_as_one_in_order() -> None:
    from transfer import wire

    one: list[wire.Message] = [wire.Push("a", (wire.WireRun(1, 2, 3, 4),))]
    assert len(wire.encode(one)) == 1
    assert wire.decode(wire.encode(one)[0], wire.TO_CONSUMER) == one  # a lone message as itself
    many: list[wire.Message] = [wire.Push("a", ()), wire.Finish("a", 0, TransferNotice(
        "a", 1, False, 0)), wire.Ping()]
    frames = wire.encode(many)
    assert len(frames) == 1
    assert wire.decode(frames[0], wire.TO_CONSUMER) == many
    ack = wire.encode([wire.Ack("b")])
    assert wire.decode(ack[0], wire.TO_PRODUCER) == [wire.Ack("b")]


class _SlowToDie(IOLoop):
    """A loop whose on_stop takes a while: stop() lands while the crashed loop is still alive."""

    def __init__(self) -> None:
        super().__init__("slow-to-die")
        self.releasing = threading.Event()

    def on_stop(self) -> None:
        self.releasing.set()
        time.sleep(0.3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # on purpose
def test_stopping_a_crashed_loop_still_in_on_stop_frees_its_context() -> None:
    # seen in CI: the fixture's stop() raised "I/O thread died" from call() and never
    # destroyed the ZMQ context (the run then hung after its summary; cause not proven)
    loop = _SlowToDie()
    loop.start()
    loop.call(lambda: None.missing)  # type: ignore[attr-defined]  # any crash on the thread
    assert loop.releasing.wait(10)
    assert loop.error is not None and loop._thread.is_alive()
    loop.stop()
    assert not loop._thread.is_alive()
    assert loop.zctx.closed
    loop.stop()  # a second stop is harmless
    with pytest.raises(RuntimeError, match="I/O thread died"):
        loop.call(lambda: None)
