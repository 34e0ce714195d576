"""bench/hbm_reader.py's Triton streaming sum reads every element exactly once, whatever the
grid, tile and tail (a reader that skipped or re-read tiles would time the wrong bytes and
make every floor wrong). On CPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def hbm_reader():
    if not CUDA:  # read when the @triton.jit kernel is defined, at the module's import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module("bench.hbm_reader")


@pytest.mark.parametrize("tiles,tail,programs", [(4, 0, 2), (3, 5, 2), (5, 17, 3), (1, 0, 4)])
def test_every_element_read_once(hbm_reader, tiles, tail, programs):
    block = 64
    n = tiles * block + tail
    dev = "cuda" if CUDA else "cpu"
    ones = torch.ones(n, dtype=torch.bfloat16, device=dev)
    parts = hbm_reader.triton_sum(ones, programs, block, 4)
    assert parts.shape == (programs,)
    assert parts.sum().item() == n  # a skipped or repeated tile would change the count
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).to(dev)
    got = hbm_reader.triton_sum(x, programs, block, 4).double().sum().item()
    assert got == pytest.approx(x.double().sum().item(), abs=1e-3)


def test_a_tensor_it_cannot_stream_is_refused(hbm_reader):
    x = torch.ones(8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: need a contiguous 1-D tensor"):
        hbm_reader.triton_sum(x, 2, 64, 4)
