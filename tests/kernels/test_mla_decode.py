"""Triton paged MLA decode (absorbed form) and the latent store, against the torch
references; the reference itself against attention over the decompressed K/V."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_kv import store_latent_ref
from kernels.ref_mla_decode import mla_decode_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def paged_latent(lens: list[int], bs: int, width: int, dtype: torch.dtype,
                 gen: torch.Generator, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-major latent cache [NB, L=2, 1, BS, 1, W] of random data (layer 1 returned
    as the strided view [NB, 1, BS, 1, W]) and a block table [B, W] int32 of scattered
    blocks whose unused tail entries point at other requests' blocks."""
    per_req = [max(1, -(-n // bs)) for n in lens]
    num_blocks = sum(per_req) + 3
    cache = torch.randn(num_blocks, 2, 1, bs, 1, width, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens), max(per_req) + 2), generator=gen)
    start = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[start:start + n]
        start += n
    return cache.to(device)[:, 1], table.to(device=device, dtype=torch.int32)


def run_form(form, launches, lens, bs, heads, c, r, dtype, gen, device, close, **kw):
    """mla_decode in the named form against the reference, on a cache whose token slots
    past each request's context hold NaN (a form that reads whole pages and failed to zero
    their tails would poison its output: 0 x NaN); launches: the form's launch calls
    (conftest's count_launches), one more of which the call must make."""
    kv, table = paged_latent(lens, bs, c + r, dtype, gen, device)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = mla_decode_ref(q, kv, table, seq_lens, 0.13, c)  # before the NaN: it reads pages
    for i, n in enumerate(lens):
        if n % bs:  # the request's last page (its own block): NaN past the context
            kv[int(table[i, n // bs]), 0, n % bs:] = float("nan")
    from kernels.triton_mla_decode import mla_decode
    out = torch.full((len(lens), heads, c), float("nan"), dtype=dtype, device=device)
    before = len(launches)
    assert mla_decode(q, kv, table, seq_lens, 0.13, c, out=out, form=form, **kw) is out
    assert len(launches) == before + 1, f"the {form} form did not run"
    close(out, ref, dtype)
    return out


def float8_form(form, lens, gen, device):
    """An e4m3 latent cache (scale 2) read in the named form, split in two: (output, the
    reference on the cache's values times its scale)."""
    from kernels.triton_mla_decode import mla_decode
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    kv8 = (kv / 2.0).to(torch.float8_e4m3fn)
    q = torch.randn(len(lens), 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    got = mla_decode(q, kv8, table, seq_lens, 0.2, 32, kv_scale=2.0, num_splits=2, form=form)
    return got, mla_decode_ref(q, kv8.to(torch.float32) * 2.0, table, seq_lens, 0.2, 32)


def _case(lens, bs, heads, c, r, dtype, gen, device, close, **kw):
    kv, table = paged_latent(lens, bs, c + r, dtype, gen, device)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = 0.11
    ref = mla_decode_ref(q, kv, table, seq_lens, scale, c)
    from kernels.triton_mla_decode import mla_decode
    out = torch.full((len(lens), heads, c), float("nan"), dtype=dtype, device=device)
    res = mla_decode(q, kv, table, seq_lens, scale, c, out=out, **kw)
    assert res is out
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode(dtype, num_splits, gen, device, close):
    # 20 heads: two head blocks of 16, the second partly padding
    _case([1, 16, 48, 37], 16, 20, 32, 16, dtype, gen, device, close,
          num_splits=num_splits, block_n=16)


def test_mla_decode_non_power_of_two_widths(gen, device, close):
    # C and R padded to their powers of two inside the kernel, masked on load and store
    _case([5, 33], 8, 4, 24, 8, torch.float32, gen, device, close, num_splits=2, block_n=16)


def test_mla_decode_graph_mode_splits_per_request(gen, device, close):
    # no max_seq_len (a CUDA graph): splits sized for the table's capacity, each request
    # spreads its own context; a length-0 row (graph padding) gets zeros
    from kernels.triton_mla_decode import choose_num_splits
    assert choose_num_splits(1, 1, 2048, device) > 1
    lens = [600, 0, 17]
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    q = torch.randn(3, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    from kernels.triton_mla_decode import mla_decode
    out = mla_decode(q, kv, table, seq_lens, 0.2, 32, block_n=16)
    close(out, mla_decode_ref(q, kv, table, seq_lens, 0.2, 32), torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_mla_decode_few_programs_split_short_contexts(gen, device, close):
    # One request (one head block): a short context is split finer than MIN_SPLIT_TOKENS,
    # so a 512-token context at batch 1 spreads over several programs, in graph mode (each
    # request sizes its own splits) and with a host-side length alike.
    import kernels.triton_mla_decode as m
    few = m.FEW_PROGRAMS_MIN_SPLIT_TOKENS
    assert few < m.MIN_SPLIT_TOKENS
    assert m.min_split_tokens(1, 1) == few
    assert m.min_split_tokens(m.FEW_PROGRAMS + 1, 1) == m.MIN_SPLIT_TOKENS
    assert m.choose_num_splits(1, 1, 512, device) > -(-512 // m.MIN_SPLIT_TOKENS)
    lens = [3 * few + 5]  # four splits of `few` tokens, the last short
    kv, table = paged_latent(lens, 16, 48, torch.float32, gen, device)
    q = torch.randn(1, 4, 48, generator=gen).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = mla_decode_ref(q, kv, table, seq_lens, 0.2, 32)
    close(m.mla_decode(q, kv, table, seq_lens, 0.2, 32, block_n=16), ref, torch.float32)
    close(m.mla_decode(q, kv, table, seq_lens, 0.2, 32, block_n=16, max_seq_len=lens[0]),
          ref, torch.float32)


@pytest.mark.parametrize(("batch", "want"), [(128, 2), (32, 8), (8, 33), (64, 4), (1, 64),
                                           (132, 2), (133, 7), (300, 7)])
def test_splits_fill_whole_waves(monkeypatch, batch, want):
    # 132 SMs of two programs each (an H100 or H200): up to 132 requests the split count
    # fills one wave and never spills a second wave of stragglers (batch 128 at 3 splits:
    # 384 programs for 264 places); past it, whole waves (133 x 7 = 931 programs, 3.5 of
    # 4 waves). Within the least split size (256 tokens; 64 at up to FEW_PROGRAMS
    # programs) and MAX_SPLITS.
    import kernels.triton_mla_decode as m
    monkeypatch.setattr(m, "_num_sms", lambda device: 132)
    monkeypatch.setattr(m, "PROGRAMS_PER_SM", 2)
    splits = m.choose_num_splits(batch, 1, 4096, torch.device("cuda"))
    assert splits == want
    assert batch > 132 or batch * splits <= 2 * 132


def test_reference_equals_attention_on_decompressed_kv(gen):
    # The absorbed form is attention over K = [c W_UK | k_pe], V = c W_UV, reassociated.
    heads, dn, dv, c, r, n = 3, 8, 6, 16, 4, 21
    lat = torch.randn(n, c + r, generator=gen)  # the context, in order
    w_uk = torch.randn(heads, dn, c, generator=gen)
    w_uv = torch.randn(heads, dv, c, generator=gen)
    q_nope = torch.randn(heads, dn, generator=gen)
    q_pe = torch.randn(heads, r, generator=gen)
    k = torch.cat([torch.einsum("sc,hdc->hsd", lat[:, :c], w_uk),
                   lat[None, :, c:].expand(heads, n, r)], -1)  # [H, S, Dn + R]
    v = torch.einsum("sc,hdc->hsd", lat[:, :c], w_uv)  # [H, S, Dv]
    p = torch.softmax(torch.einsum("hd,hsd->hs", torch.cat([q_nope, q_pe], -1), k) * 0.3, -1)
    want = torch.einsum("hs,hsd->hd", p, v)
    # three blocks of 7 tokens, stored out of order: the table gives the context's order
    kv = torch.zeros(3, 1, 7, 1, c + r)
    kv[torch.tensor([2, 0, 1]), 0, :, 0] = lat.reshape(3, 7, c + r)
    q = torch.cat([torch.einsum("hd,hdc->hc", q_nope, w_uk), q_pe], -1)[None]
    o = mla_decode_ref(q, kv, torch.tensor([[2, 0, 1]]), torch.tensor([n]), 0.3, c)
    got = torch.einsum("hc,hdc->hd", o[0], w_uv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_latent(dtype, gen, device):
    from kernels.triton_store_kv import store_latent
    cache = torch.zeros(5, 2, 1, 4, 1, 40, dtype=dtype, device=device)[:, 1]
    want = cache.clone()
    lat = torch.randn(6, 40, generator=gen).to(dtype=dtype, device=device)
    slots = torch.tensor([3, -1, 17, 8, -1, 0], device=device)
    store_latent(lat, cache, slots)
    store_latent_ref(lat, want, slots)
    assert torch.equal(cache, want)
    assert torch.equal(cache[4, 0, 1, 0], lat[2])  # slot 17 = block 4, offset 1
    assert int((cache != 0).any(-1).sum()) == 4  # padding rows wrote nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_deepseek_sizes(heads, gen, device, close):
    # DeepSeek's latent (512 + 64), long contexts, split and graph-style launches
    lens = [4096, 1, 777, 3000]
    _case(lens, 64, heads, 512, 64, torch.bfloat16, gen, device, close)
    _case(lens, 64, heads, 512, 64, torch.bfloat16, gen, device, close, max_seq_len=4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bs", [16, 64])
def test_tma_form_at_deepseek_sizes(bs, count_launches, gen, device, close):
    # the TMA form (tests/kernels/test_mla_decode_tma.py) compiled for the GPU: DeepSeek's
    # latent (512 + 64), long contexts, host-sized and graph-style splits
    import kernels.triton_mla_decode_tma as mod
    launches = count_launches(mod)
    lens = [4096, 1, 777, 3000]
    for kw in ({}, {"max_seq_len": 4096}):
        run_form("tma", launches, lens, bs, 16, 512, 64, torch.bfloat16, gen, device, close, **kw)
