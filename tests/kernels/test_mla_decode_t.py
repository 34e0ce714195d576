"""The transposed form of paged MLA decode (tokens as the products' rows) against the torch
reference: tiles of 16-64 tokens across pages, split and unsplit, graph-style launches,
C and R padded to powers of two, float32 and 16-bit caches (a float8 cache keeps the pointer
form)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import float8_form, paged_latent, run_form


@pytest.fixture
def launches(count_launches):
    """The transposed form's launches (a silent fall back to the pointer form would pass every
    value check)."""
    import kernels.triton_mla_decode_t as t
    return count_launches(t)


def _run(lens, bs, heads, c, r, dtype, gen, device, close, launches, **kw):
    return run_form("transposed", launches, lens, bs, heads, c, r, dtype, gen, device, close,
                    **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_transposed(dtype, num_splits, gen, device, close, launches):
    # 64-token tiles over 16-token pages; 20 heads: two head blocks, the second partly
    # padding; contexts ending mid-tile and on one
    _run([1, 64, 150, 37], 16, 20, 32, 16, dtype, gen, device, close, launches,
         num_splits=num_splits)


@pytest.mark.parametrize("block_n", [16, 32])
def test_smaller_tiles_and_padded_widths(block_n, gen, device, close, launches):
    # C and R not powers of two (padded, masked), pages of 8 tokens
    _run([5, 33, 70], 8, 4, 24, 8, torch.float32, gen, device, close, launches, num_splits=2,
         block_n=block_n)


def test_graph_mode_splits_per_request(gen, device, close, launches):
    # no max_seq_len: splits sized for the table's capacity, each request spreading its own
    # context; a length-0 row gets zeros
    out = _run([300, 0, 17], 16, 4, 32, 16, torch.float32, gen, device, close, launches)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_float8_cache_keeps_the_pointer_form(gen, device, close, launches):
    got, want = float8_form("transposed", [90, 9], gen, device)
    assert launches == []
    close(got, want, torch.float32)


def test_form_takes_its_own_tile(monkeypatch, gen, device, launches):
    import kernels.triton_mla_decode as m
    import kernels.triton_mla_decode_t as t
    lens = [40]
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    q = torch.randn(1, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    monkeypatch.setattr(m, "FORM", "transposed")
    assert t.BLOCK_N != m.BLOCK_N
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32).block_n == t.BLOCK_N
    assert launches == [1]
