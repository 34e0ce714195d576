"""Triton paged attention (prefill and decode) against the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_attention import decode_attention_ref, prefill_attention_ref

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (GQA ratio, head_dim): every ratio with each head dim
HEADS = [(1, 64), (3, 128), (8, 64), (1, 128), (3, 64), (8, 128)]


def paged_kv(lens: list[int], bs: int, hkv: int, d: int, dtype: torch.dtype,
             gen: torch.Generator, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-major cache [NB, L=2, 2, BS, Hkv, D] of random data (layer 1 returned as the
    strided view [NB, 2, BS, Hkv, D]) and a block table [B, W] int32 of scattered blocks,
    whose unused tail entries point at other requests' blocks (random data, not zeros)."""
    per_req = [-(-n // bs) for n in lens]
    num_blocks = sum(per_req) + 3
    cache = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens), max(per_req) + 2), generator=gen)
    start = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[start:start + n]
        start += n
    return cache.to(device)[:, 1], table.to(device=device, dtype=torch.int32)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
          device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


# --- decode ----------------------------------------------------------------------------

# (batch lens, block size, Hkv, tile kwargs): small for the interpreter; real sizes on GPU.
DECODE_SMALL = ([1, 16, 48, 37, 50], 16, 2, {"block_n": 16})


def _decode_case(lens: list[int], bs: int, hkv: int, g: int, d: int, dtype: torch.dtype,
                 gen: torch.Generator, device: torch.device, num_splits: int | None,
                 kw: dict[str, int], close) -> None:
    kv, table = paged_kv(lens, bs, hkv, d, dtype, gen, device)
    q = _rand((len(lens), hkv * g, d), dtype, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    ref = decode_attention_ref(q, kv, table, seq_lens, scale)
    from kernels.triton_decode_attention import decode_attention
    out = torch.full_like(q, float("nan"))
    res = decode_attention(q, kv, table, seq_lens, scale, out=out, num_splits=num_splits, **kw)
    assert res is out
    close(out, ref, dtype)


@pytest.mark.parametrize("g,d", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(g, d, dtype, num_splits, gen, device, close):
    lens, bs, hkv, kw = DECODE_SMALL
    _decode_case(lens, bs, hkv, g, d, dtype, gen, device, num_splits, kw, close)


def test_decode_heuristic_splits_long_context(gen, device, close):
    # One request, one KV head: the heuristic must split a 600-token context.
    from kernels.triton_decode_attention import choose_num_splits, min_split_tokens
    assert choose_num_splits(1, 1, 600, device) > 1
    # few (request, KV head) pairs split finer than many do
    assert min_split_tokens(1, 8) < min_split_tokens(8, 8)
    assert choose_num_splits(1, 8, 512, device) > choose_num_splits(8, 8, 512, device)
    _decode_case([600], 16, 1, 4, 64, torch.bfloat16, gen, device, None, {"block_n": 32},
                  close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,d", [(4, 128), (3, 128), (1, 64)])
@pytest.mark.parametrize("batch,max_len,num_splits",
                         [(32, 4096, None), (4, 32768, None), (256, 1024, None), (32, 4096, 1)])
@pytest.mark.gpu
@needs_cuda
def test_decode_gpu(g, d, dtype, batch, max_len, num_splits, gen, close):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    _decode_case(lens, 16, 8, g, d, dtype, gen, torch.device("cuda"), num_splits, {}, close)



# --- prefill ---------------------------------------------------------------------------

# (cached tokens, chunk length) per request: empty chunk, single token, block multiples
# (16) and not, chunk longer than one query tile.
PREFILL_SMALL = [(0, 20), (16, 16), (37, 5), (5, 1), (10, 0), (3, 33)]


def prefill_inputs(reqs: list[tuple[int, int]], bs: int, hkv: int, g: int, d: int,
                   dtype: torch.dtype, gen: torch.Generator, device: torch.device):
    """A prefill step's (q, kv, block table, cu_seqlens, seq_lens) for requests given as
    (cached tokens, chunk length)."""
    lens = [c + n for c, n in reqs]
    kv, table = paged_kv(lens, bs, hkv, d, dtype, gen, device)
    chunk = [n for _, n in reqs]
    cu = torch.tensor([0] + chunk, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    q = _rand((sum(chunk), hkv * g, d), dtype, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kv, table, cu, seq_lens


def _prefill_case(reqs: list[tuple[int, int]], bs: int, hkv: int, g: int, d: int,
                  dtype: torch.dtype, gen: torch.Generator, device: torch.device,
                  kw: dict[str, int], close) -> None:
    q, kv, table, cu, seq_lens = prefill_inputs(reqs, bs, hkv, g, d, dtype, gen, device)
    scale = d ** -0.5
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, scale)
    from kernels.triton_prefill_attention import prefill_attention
    out = torch.full_like(q, float("nan"))
    res = prefill_attention(q, kv, table, cu, seq_lens, scale, out=out, **kw)
    assert res is out
    close(out, ref, dtype)


@pytest.mark.parametrize("g,d", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(g, d, dtype, gen, device, close):
    _prefill_case(PREFILL_SMALL, 16, 1 if g == 8 else 2, g, d, dtype, gen, device,
                  {"block_m": 16, "block_n": 16}, close)


def test_prefill_many_requests(gen, device, close):
    # 19 requests, mostly one-token chunks (as decode rows in a mixed batch), some empty:
    # exercises the grid-slot -> request binary search over an odd, non-power-of-two B.
    reqs = [(int(c), int(n)) for c, n in zip(torch.randint(0, 40, (19,), generator=gen),
                                             torch.randint(0, 3, (19,), generator=gen),
                                             strict=True)]
    reqs[7] = (0, 21)
    _prefill_case(reqs, 8, 1, 2, 64, torch.float32, gen, device,
                  {"block_m": 16, "block_n": 16}, close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,d", [(4, 128), (3, 128), (1, 64), (8, 128)])
@pytest.mark.gpu
@needs_cuda
def test_prefill_gpu(g, d, dtype, gen, close):
    # A 4k fresh prompt, chunked prefills after long contexts, and a ragged mix.
    reqs = [(0, 4096), (2048, 1024), (7000, 512), (123, 777), (0, 1), (4095, 1)]
    _prefill_case(reqs, 16, 8 if g != 8 else 4, g, d, dtype, gen, torch.device("cuda"), {},
                  close)



def test_decode_rejects_bad_shapes(device):
    from kernels.triton_decode_attention import decode_attention
    kv = torch.zeros(4, 2, 16, 2, 64, device=device)
    q = torch.zeros(2, 3, 64, device=device)  # 3 q heads over 2 KV heads
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kv, table, lens, 1.0)


def test_decode_split_k_sized_from_real_lengths(gen, device, close):
    # A block table far wider than the contexts: the max_seq_len hint sizes the splits
    # from the real lengths (fewer, fuller splits) and the result is unchanged.
    from kernels.triton_decode_attention import choose_num_splits, decode_attention

    lens = [40, 64, 17]
    kv, table = paged_kv(lens, 16, 1, 64, torch.float32, gen, device)
    table = torch.cat([table, table.new_zeros(len(lens), 60)], dim=1)  # capacity ~1.1k
    q = _rand((len(lens), 2, 64), torch.float32, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq_lens, 0.125)
    assert choose_num_splits(3, 1, 64, device) < choose_num_splits(3, 1, table.shape[1] * 16,
                                                                     device)
    out = decode_attention(q, kv, table, seq_lens, 0.125, max_seq_len=max(lens), block_n=16)
    close(out, ref, torch.float32)


def test_decode_splits_sized_per_request_on_the_device(gen, device, close):
    # No hint (as inside a CUDA graph): the grid has the capacity's splits and each request
    # spreads its own context over them; short ones use one split, long ones all, evenly.
    from kernels.triton_decode_attention import decode_attention, min_split_tokens

    lens = [1700, 40, min_split_tokens(4, 1) + 1, 1]
    kv, table = paged_kv(lens, 16, 1, 64, torch.float32, gen, device)
    table = torch.cat([table, table.new_zeros(len(lens), 20)], dim=1)
    q = _rand((len(lens), 2, 64), torch.float32, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq_lens, 0.125)
    out = decode_attention(q, kv, table, seq_lens, 0.125, num_splits=5, block_n=16)
    close(out, ref, torch.float32)


@pytest.mark.parametrize("fused", [True, False])
def test_decode_merges_the_splits_a_request_sized_for_itself(fused, gen, device, close):
    # 520 tokens over 8 splits of at least 64 (the launch's least) size their own splits at
    # 80 tokens (65 rounded up to the 16-token tile), so 7 of the 8 splits hold tokens: the
    # merge must count 7 (from the request's split size), not ceil(520 / 64) = 9 clipped to 8,
    # or the fused merge waits for an eighth split that never comes and writes nothing.
    import kernels.triton_decode_attention as tda
    from kernels.triton_decode_attention import decode_attention, min_split_tokens

    assert min_split_tokens(3, 1) == 64
    lens = [520, 30, 1]
    kv, table = paged_kv(lens, 16, 1, 64, torch.float32, gen, device)
    # a 1,024-token table: 8 splits of 128 at the launch (none emptied by rounding)
    table = torch.cat([table, table.new_zeros(len(lens), 64 - table.shape[1])], dim=1)
    q = _rand((len(lens), 2, 64), torch.float32, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq_lens, 0.125)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, table, seq_lens, 0.125, out=out, num_splits=8, block_n=16,
                     fused_merge=fused)
    close(out, ref, torch.float32)
    if fused:  # and every pair's counter back at zero for the next launch
        assert int(tda._counters[q.device].count_nonzero()) == 0
