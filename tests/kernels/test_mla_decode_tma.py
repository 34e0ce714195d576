"""The copy-engine (TMA) form of paged MLA decode against the torch reference: one and two
column boxes of C, whole and partial last pages whose tails hold NaN, split and unsplit,
graph-style launches, a float8 cache; and which calls it takes (tma_fits)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_mla_decode import mla_decode_ref
from tests.kernels.test_mla_decode import paged_latent


def _run(lens, bs, heads, c, r, dtype, gen, device, close, **kw):
    kv, table = paged_latent(lens, bs, c + r, dtype, gen, device)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = mla_decode_ref(q, kv, table, seq_lens, 0.13, c)  # (it reads whole pages too)
    # every token slot past its request's context holds NaN: the form reads whole pages,
    # so a tail it failed to zero would poison the output (0 x NaN)
    for i, n in enumerate(lens):
        if n % bs:  # the request's last page (its own block): NaN past the context
            kv[int(table[i, n // bs]), 0, n % bs:] = float("nan")
    from kernels.triton_mla_decode import mla_decode
    from kernels.triton_mla_decode_tma import tma_fits
    assert tma_fits(q, kv, c)
    out = torch.full((len(lens), heads, c), float("nan"), dtype=dtype, device=device)
    res = mla_decode(q, kv, table, seq_lens, 0.13, c, out=out, form="tma", **kw)
    assert res is out
    close(out, ref, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_box(dtype, num_splits, gen, device, close):
    # C = 32 in one box; 20 heads: two head blocks, the second partly padding
    lens = [1, 16, 50, 37]  # contexts ending mid-page and on one
    _run(lens, 16, 20, 32, 16, dtype, gen, device, close, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_two_boxes(num_splits, gen, device, close):
    # C past the copy engine's 256-column box: two boxes, two accumulators (DeepSeek's 512)
    import kernels.triton_mla_decode_tma as t
    assert t.c_box(512) == 256 and t.c_box(64) == 64
    _run([70, 5], 16, 4, 512, 64, torch.bfloat16, gen, device, close, num_splits=num_splits)


def test_pages_in_several_tiles(monkeypatch, gen, device, close):
    # pages of 64 tokens in TILE_ROWS-row tiles: a tile's row offset within its page
    import kernels.triton_mla_decode_tma as t
    monkeypatch.setattr(t, "TILE_ROWS", 16)
    assert t.tile_rows(64) == 16 and t.tile_rows(16) == 16
    for splits in (1, 3):
        _run([150, 64, 9], 64, 4, 32, 16, torch.float32, gen, device, close, num_splits=splits)


def test_graph_mode_splits_per_request(gen, device, close):
    # no max_seq_len: splits sized for the table's capacity in whole pages, each request
    # spreading its own context; a length-0 row gets zeros
    lens = [300, 0, 17]
    out = _run(lens, 16, 4, 32, 16, torch.float32, gen, device, close)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_float8_cache(gen, device, close):
    # an e4m3 cache is upcast on load; its scale folds into the scores and the output
    from kernels.triton_mla_decode import mla_decode
    lens = [40, 9]
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    kv8 = (kv / 2.0).to(torch.float8_e4m3fn)
    q = torch.randn(2, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    got = mla_decode(q, kv8, table, seq_lens, 0.2, 32, kv_scale=2.0, num_splits=2, form="tma")
    want = mla_decode_ref(q, kv8.to(torch.float32) * 2.0, table, seq_lens, 0.2, 32)
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


def test_form_switch(monkeypatch, gen, device):
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
    monkeypatch.setattr(m, "FORM", "tma")
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32).block_n == 64
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, block_n=16).block_n == 16
    with pytest.raises(ValueError, match="form: 'fast'"):
        m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, form="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bs", [16, 64])
def test_deepseek_sizes(bs, gen, device, close):
    # DeepSeek's latent (512 + 64), long contexts, host-sized and graph-style splits
    lens = [4096, 1, 777, 3000]
    _run(lens, bs, 16, 512, 64, torch.bfloat16, gen, device, close)
    _run(lens, bs, 16, 512, 64, torch.bfloat16, gen, device, close, max_seq_len=4096)
