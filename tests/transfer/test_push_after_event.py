"""A push given ``after`` (the event recorded after the kernels that wrote its blocks) moves
its bytes as soon as that event completes, though the stream runs on: a producer's push made
while its next step runs (LLMEngine.device_wait) must not wait for that step. Without
``after`` it waits for all the stream's work so far. A real ucx pair on one GPU, in one process."""

from __future__ import annotations

import time

import pytest
import torch
from xfer_helpers import LAYOUT, cfg

from transfer import TransferNotice, TransferStatus, make_receiver, make_sender

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second on an H200


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYOUT.num_blocks, *LAYOUT.block_shape)
    src = torch.randn(shape, device="cuda").to(torch.bfloat16)
    return src, torch.full(shape, -1.0, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["ucx"])
@pytest.mark.parametrize("given", [True, False])
def test_a_push_waits_for_its_event_not_for_the_stream(backend: str, given: bool) -> None:
    src, dst = _pools()
    rx = make_receiver(dst, LAYOUT, cfg(backend))
    tx = make_sender(src, LAYOUT, cfg(backend))
    try:
        tx.connect(rx.address, timeout=10)
        rx.expect("r", [3, 4])
        written = torch.cuda.Event()
        written.record()  # the blocks' writes (the randn above) end here
        torch.cuda._sleep(BUSY_CYCLES)  # the next step: the stream stays busy
        t0 = time.monotonic()
        tx.push("r", rx.address, [1, 2], [3, 4], after=written if given else None)
        tx.finish("r", TransferNotice("r", 7, False, 2 * LAYOUT.block_size))
        got = rx.wait("r", 30)
        took = time.monotonic() - t0
        busy = not torch.cuda.current_stream().query()
        assert got.status == TransferStatus.DONE, got
        assert torch.equal(dst[3:5].cpu(), src[1:3].cpu())
        if given:
            assert busy and took < 0.5, took  # landed while the "next step" still ran
        else:
            assert not busy  # it waited for the whole stream
        torch.cuda.synchronize()
    finally:
        tx.close()
        rx.close()
