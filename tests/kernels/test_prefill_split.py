"""Prefill attention with its key range split over several programs (split-K) and merged:
against the torch reference, and against the unsplit kernel. On CPU the Triton code runs
in the interpreter at tiny shapes; the GPU cases (marked gpu) run Llama-3-8B's heads."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_attention import prefill_attention_ref
from tests.kernels.test_attention import _rand, needs_cuda, paged_kv, prefill_inputs

TILES = {"block_m": 16, "block_n": 16}
# (cached tokens, chunk length) per request: a chunk starting mid-block after a cached
# prefix (37 = 2 blocks + 5), one starting on a block boundary, a chunk longer than one
# query tile after a prefix, a fresh prompt, a single token, an empty chunk.
MIXED = [(37, 5), (48, 16), (21, 40), (0, 20), (70, 1), (9, 0)]


def _run(q, kv, table, cu, seq_lens, scale, **kw) -> torch.Tensor:
    from kernels.triton_prefill_attention import prefill_attention

    out = torch.full_like(q, float("nan"))  # a row no split or merge wrote stays NaN
    res = prefill_attention(q, kv, table, cu, seq_lens, scale, out=out, **kw)
    assert res is out
    return out


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("g,dtype", [(4, torch.float32), (1, torch.bfloat16)])
def test_split_matches_reference(num_splits, g, dtype, gen, device, close):
    # 7 splits over at most 85 keys: some splits of some tiles get no keys at all.
    q, kv, table, cu, seq_lens = prefill_inputs(MIXED, 16, 2, g, 64, dtype, gen, device)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.125)
    out = _run(q, kv, table, cu, seq_lens, 0.125, num_splits=num_splits, **TILES)
    close(out, ref, dtype)


def test_split_equals_unsplit(gen, device):
    # Same float32 data split and not: only the merge's rounding may differ.
    reqs = [(100, 24), (33, 7), (64, 3)]
    q, kv, table, cu, seq_lens = prefill_inputs(reqs, 8, 2, 3, 32, torch.float32, gen, device)
    one = _run(q, kv, table, cu, seq_lens, 0.2, num_splits=1, **TILES)
    four = _run(q, kv, table, cu, seq_lens, 0.2, num_splits=4, **TILES)
    assert torch.allclose(one, four, rtol=1e-5, atol=1e-5)
    assert not torch.equal(one, torch.zeros_like(one))


def test_diagonal_run_crosses_a_split_boundary(gen, device, close):
    # One tile of 16 queries after 40 cached tokens: keys [0, 56), diag 32, runs of 32 keys
    # with 2 splits, so the masked part [32, 56) starts its own run; with 3 splits (runs of
    # 32 too: ceil(ceil(56 / 3) / 16) * 16) the third split has no keys.
    q, kv, table, cu, seq_lens = prefill_inputs([(40, 16)], 16, 1, 2, 32, torch.float32, gen,
                                                device)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.3)
    for s in (2, 3):
        close(_run(q, kv, table, cu, seq_lens, 0.3, num_splits=s, **TILES), ref, torch.float32)


def test_heuristic_splits_a_short_chunk_after_a_long_prefix(gen, device, close):
    # The launcher chooses the split itself (the interpreter counts 4 SMs): one 16-query
    # tile per head after 600 cached tokens leaves SMs idle, so it splits.
    from kernels.triton_prefill_split import choose_prefill_splits

    assert choose_prefill_splits(1, 2, 616, device) > 1
    q, kv, table, cu, seq_lens = prefill_inputs([(600, 16)], 16, 1, 2, 32, torch.bfloat16, gen,
                                       device)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.17)
    close(_run(q, kv, table, cu, seq_lens, 0.17, max_seq_len=616, **TILES), ref,
          torch.bfloat16)


def test_split_count_policy(monkeypatch):
    from kernels import triton_prefill_split as sp

    h200 = torch.device("cuda", 0)
    monkeypatch.setattr(sp, "num_sms", lambda dev: 132)
    # 8B: 32 heads, a 128-query chunk after 2,048 cached tokens: the 32 programs split
    # into 4 runs of 544 keys, 128 programs on 132 SMs (PROGRAMS_PER_SM 1)
    assert sp.PROGRAMS_PER_SM == 1
    assert sp.choose_prefill_splits(1, 32, 2176, h200) == 4
    # twice the programs per SM, twice the splits
    assert sp.choose_prefill_splits(1, 32, 2176, h200, programs_per_sm=2) == 8
    # keys bound the split: never under MIN_SPLIT_KEYS keys a split
    assert sp.choose_prefill_splits(1, 32, 3 * sp.MIN_SPLIT_KEYS, h200) == 3
    assert sp.choose_prefill_splits(1, 32, sp.MIN_SPLIT_KEYS - 1, h200) == 1
    # a long chunk (16 tiles x 32 heads = 512 programs) fills the GPU: no split
    assert sp.choose_prefill_splits(16, 32, 8192, h200) == 1
    # one head, a huge context: capped
    assert sp.choose_prefill_splits(1, 1, 1 << 20, h200) == sp.MAX_SPLITS
    assert sp.max_query_tiles(128, 1, 128) == 1
    assert sp.max_query_tiles(129, 1, 128) == 2
    assert sp.max_query_tiles(0, 3, 128) == 0
    # requests of 1, 1 and 128 queries: 3 tiles, and the bound covers them
    assert sp.max_query_tiles(130, 3, 128) >= 3


def test_split_over_a_float8_cache(gen, device):
    from tests.kernels.test_kv_fp8 import K_SCALE, V_SCALE, _prefill_fp8

    # K_SCALE and V_SCALE must survive the split: the partials carry V's, the lse K's.
    assert K_SCALE != 1.0 and V_SCALE != 1.0
    _prefill_fp8([(37, 5), (50, 17), (0, 9)], 2, 2, 32, torch.float32, gen, device, 1e-4,
                 block_m=16, block_n=16, num_splits=3)


def test_bad_split_count_is_refused(device):
    from kernels.triton_prefill_attention import prefill_attention

    q = torch.zeros(4, 2, 32, device=device)
    kv = torch.zeros(2, 2, 16, 1, 32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_splits"):
        prefill_attention(q, kv, table, cu, lens, 1.0, num_splits=0)


def test_engine_dispatch_sizes_the_split_from_the_step(gen, device, close, monkeypatch):
    # PagedAttention hands the step's max_seq_len to the Triton launcher: 16 new tokens
    # after 600 cached split into 616 // MIN_SPLIT_KEYS = 2 runs, where the block table's
    # capacity (1,024 tokens) alone would have given 4. Same output as the references.
    import kernels.triton_prefill_attention as tpa
    from engine.attention import AttentionMetadata, KernelSet, PagedAttention, kernels_for
    from engine.rope import cos_sin_table
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_norm import rms_norm, rope
    from kernels.triton_store_kv import store_kv

    used: list[int] = []
    merge = tpa.merge_splits

    def spy(part_o, part_lse, out, num_splits, **kw):
        used.append(num_splits)
        merge(part_o, part_lse, out, num_splits, **kw)

    monkeypatch.setattr(tpa, "merge_splits", spy)
    tri = KernelSet(store_kv, tpa.prefill_attention, decode_attention, rms_norm, rope,
                    "triton", lambda x: x)
    cached, n, bs, hkv, g, d = 600, 16, 16, 1, 1, 32  # one head: 4 (interpreter) SMs idle
    kv, table = paged_kv([cached + n], bs, hkv, d, torch.float32, gen, device)
    table = torch.cat([table, table.new_zeros(1, 64 - table.shape[1])], dim=1)
    pos = torch.arange(cached, cached + n, device=device)
    slots = table[0].long()[pos // bs] * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=table,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([cached + n], dtype=torch.int32, device=device),
        decode_only=False, max_seq_len=cached + n)
    q = _rand((n, hkv * g, d), torch.float32, gen, device)
    k = _rand((n, hkv, d), torch.float32, gen, device)
    v = _rand((n, hkv, d), torch.float32, gen, device)
    cs = cos_sin_table(d, 1024, 10000.0, None).to(device)
    want_kv = kv.clone()
    want = PagedAttention(kernels_for(device, force_reference=True), d ** -0.5)(
        q, k, v, want_kv, meta, pos, cs)
    got = PagedAttention(tri, d ** -0.5)(q, k, v, kv, meta, pos, cs)
    assert used == [2]
    close(got, want, torch.float32)


# --- GPU, Llama-3-8B heads --------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 2, 4, 8, 16])
@pytest.mark.parametrize("reqs", [
    [(2048, 128)],  # the cached-prefix chunk this split is for
    [(2000, 128), (4097, 64), (513, 1), (0, 100)],  # prefixes of different lengths, mid-block
    [(8192, 512)],  # a longer chunk: several tiles per head
])
def test_split_gpu(num_splits, reqs, gen, close):
    dev = torch.device("cuda")
    q, kv, table, cu, seq_lens = prefill_inputs(reqs, 16, 8, 4, 128, torch.bfloat16, gen, dev)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 128 ** -0.5)
    out = _run(q, kv, table, cu, seq_lens, 128 ** -0.5, num_splits=num_splits,
               max_seq_len=max(c + n for c, n in reqs))
    close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_heuristic_splits_the_cached_prefix_chunk_on_gpu():
    from kernels.triton_prefill_attention import SHORT_BLOCK_M
    from kernels.triton_prefill_split import choose_prefill_splits, max_query_tiles

    dev = torch.device("cuda")
    tiles = max_query_tiles(128, 1, SHORT_BLOCK_M)
    assert tiles == 1
    assert choose_prefill_splits(tiles, 32, 2176, dev) > 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 4])
def test_split_fp8_gpu(num_splits, gen):
    from tests.kernels.test_kv_fp8 import _prefill_fp8

    _prefill_fp8([(2048, 128), (1000, 37)], 8, 4, 128, torch.bfloat16, gen,
                 torch.device("cuda"), 1.2e-2, num_splits=num_splits)
