"""The transposed form of paged MLA decode (tokens as the products' rows) against the torch
reference: tiles of 16-64 tokens across pages, split and unsplit, graph-style launches,
C and R padded to powers of two, float32 and 16-bit caches (a float8 cache keeps the pointer
form)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_mla_decode import mla_decode_ref
from tests.kernels.test_mla_decode import paged_latent


def _run(lens, bs, heads, c, r, dtype, gen, device, close, **kw):
    kv, table = paged_latent(lens, bs, c + r, dtype, gen, device)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    from kernels.triton_mla_decode import mla_decode
    out = torch.full((len(lens), heads, c), float("nan"), dtype=dtype, device=device)
    res = mla_decode(q, kv, table, seq_lens, 0.13, c, out=out, form="transposed", **kw)
    assert res is out
    close(out, mla_decode_ref(q, kv, table, seq_lens, 0.13, c), dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_transposed(dtype, num_splits, gen, device, close):
    # 64-token tiles over 16-token pages; 20 heads: two head blocks, the second partly
    # padding; contexts ending mid-tile and on one
    _run([1, 64, 150, 37], 16, 20, 32, 16, dtype, gen, device, close, num_splits=num_splits)


@pytest.mark.parametrize("block_n", [16, 32])
def test_smaller_tiles_and_padded_widths(block_n, gen, device, close):
    # C and R not powers of two (padded, masked), pages of 8 tokens
    _run([5, 33, 70], 8, 4, 24, 8, torch.float32, gen, device, close, num_splits=2,
         block_n=block_n)


def test_graph_mode_splits_per_request(gen, device, close):
    # no max_seq_len: splits sized for the table's capacity, each request spreading its own
    # context; a length-0 row gets zeros
    out = _run([300, 0, 17], 16, 4, 32, 16, torch.float32, gen, device, close)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_float8_cache_keeps_the_pointer_form(gen, device, close):
    from kernels.triton_mla_decode import BLOCK_N, mla_decode, mla_decode_unmerged
    lens = [90, 9]
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    kv8 = (kv / 2.0).to(torch.float8_e4m3fn)
    q = torch.randn(2, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    assert mla_decode_unmerged(q, kv8, table, seq_lens, 0.2, 32, kv_scale=2.0,
                               form="transposed").block_n == BLOCK_N
    got = mla_decode(q, kv8, table, seq_lens, 0.2, 32, kv_scale=2.0, num_splits=2,
                     form="transposed")
    want = mla_decode_ref(q, kv8.to(torch.float32) * 2.0, table, seq_lens, 0.2, 32)
    close(got, want, torch.float32)


def test_form_takes_its_own_tile(monkeypatch, gen, device):
    import kernels.triton_mla_decode as m
    import kernels.triton_mla_decode_t as t
    lens = [40]
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    q = torch.randn(1, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    monkeypatch.setattr(m, "FORM", "transposed")
    assert t.BLOCK_N != m.BLOCK_N
    assert m.mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32).block_n == t.BLOCK_N


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bs", [16, 64])
def test_deepseek_sizes(bs, gen, device, close):
    # DeepSeek's latent (512 + 64), long contexts, host-sized and graph-style splits
    lens = [4096, 1, 777, 3000]
    _run(lens, bs, 16, 512, 64, torch.bfloat16, gen, device, close)
    _run(lens, bs, 16, 512, 64, torch.bfloat16, gen, device, close, max_seq_len=4096)
