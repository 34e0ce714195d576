"""The copy-engine (TMA) form of paged MLA decode against the torch reference: one and two
column boxes of C, whole and partial last pages whose tails hold NaN, split and unsplit,
graph-style launches, a float8 cache; and which calls it takes (tma_fits)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import float8_form, paged_latent, run_form


@pytest.fixture
def launches(count_launches):
    """The TMA form's launches (a silent fall back to the pointer form would pass every
    value check)."""
    import kernels.triton_mla_decode_tma as t
    return count_launches(t)


def _run(lens, bs, heads, c, r, dtype, gen, device, close, launches, **kw):
    return run_form("tma", launches, lens, bs, heads, c, r, dtype, gen, device, close, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_box(dtype, num_splits, gen, device, close, launches):
    # C = 32 in one box; 20 heads: two head blocks, the second partly padding
    lens = [1, 16, 50, 37]  # contexts ending mid-page and on one
    _run(lens, 16, 20, 32, 16, dtype, gen, device, close, launches,
         num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_two_boxes(num_splits, gen, device, close, launches):
    # C past the copy engine's 256-column box: two boxes, two accumulators (DeepSeek's 512)
    import kernels.triton_mla_decode_tma as t
    assert t.c_box(512) == 256 and t.c_box(64) == 64
    _run([70, 5], 16, 4, 512, 64, torch.bfloat16, gen, device, close, launches,
         num_splits=num_splits)


def test_pages_in_several_tiles(monkeypatch, gen, device, close, launches):
    # pages of 64 tokens in TILE_ROWS-row tiles: a tile's row offset within its page
    import kernels.triton_mla_decode_tma as t
    monkeypatch.setattr(t, "TILE_ROWS", 16)
    assert t.tile_rows(64) == 16 and t.tile_rows(16) == 16
    for splits in (1, 3):
        _run([150, 64, 9], 64, 4, 32, 16, torch.float32, gen, device, close, launches,
             num_splits=splits)


def test_graph_mode_splits_per_request(gen, device, close, launches):
    # no max_seq_len: splits sized for the table's capacity in whole pages, each request
    # spreading its own context; a length-0 row gets zeros
    lens = [300, 0, 17]
    out = _run(lens, 16, 4, 32, 16, torch.float32, gen, device, close, launches)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_float8_cache(gen, device, close, launches):
    # an e4m3 cache is upcast on load; its scale folds into the scores and the output
    got, want = float8_form("tma", [40, 9], gen, device)
    assert launches == [1]
    close(got, want, torch.float32)


def test_which_calls_fit(device):
    # pages of 16-256 tokens (powers of two), C in one or two power-of-two boxes, R a
    # power of two: anything else keeps the pointer form
    from kernels.triton_mla_decode_tma import tma_fits

    def fits(bs: int, c: int, r: int, dtype: torch.dtype = torch.bfloat16) -> bool:
        kv = torch.zeros(3, 2, 1, bs, 1, c + r, dtype=dtype, device=device)[:, 1]
        q = torch.zeros(1, 4, c + r, dtype=torch.bfloat16, device=device)
        return tma_fits(q, kv, c)

    assert fits(16, 512, 64) and fits(64, 512, 64) and fits(16, 32, 16)
    assert not fits(8, 512, 64)  # a page under 16 tokens: under the product's least N
    assert not fits(12, 32, 16)  # not a power of two
    assert not fits(16, 24, 8)  # C not a power of two
    assert not fits(16, 1024, 64)  # more than two boxes
    assert not fits(16, 32, 8, torch.float8_e4m3fn)  # R of 8 bytes: under 16
    assert not fits(16, 32, 8)  # R of 8: under a product's least inner size (16 bytes)


def test_form_switch(monkeypatch, gen, device, launches):
    # FORM "pointer" (the default) or an explicit block_n: the pointer form's tile; "tma":
    # the page's; an unknown form: refused, naming it
    import kernels.triton_mla_decode as m
    import kernels.triton_mla_decode_tma as t
    monkeypatch.setattr(t, "TILE_ROWS", 64)  # whole 64-token pages: unlike BLOCK_N
    assert m.BLOCK_N != 64 and m.FORM == "pointer"
    lens = [40]
    kv, table = paged_latent(lens, 64, 48, torch.float32, gen, device)
    q = torch.randn(1, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32).block_n == m.BLOCK_N
    assert launches == []
    monkeypatch.setattr(m, "FORM", "tma")
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32).block_n == 64
    assert launches == [1]
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, block_n=16).block_n == 16
    assert launches == [1]  # a given block_n: the pointer form
    with pytest.raises(ValueError, match="form: 'fast'"):
        m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, form="fast")
