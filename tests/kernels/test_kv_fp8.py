"""A float8_e4m3fn KV cache: stores quantize (x / scale, saturated), attention reads
dequantize in-kernel. The references are checked against plain float math on the
dequantized cache; the Triton kernels against the references on the same float8 bytes
(the interpreter on CPU at small shapes, the GPU at real ones)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import FP8_DTYPE, FP8_MAX, from_cache, to_cache
from kernels.ref_attention import decode_attention_ref, prefill_attention_ref
from kernels.ref_kv import scatter_blocks_ref, store_kv_ref, store_latent_ref
from kernels.ref_mla_decode import mla_decode_ref
from kernels.ref_rope_kv import rope_store_kv_ref

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
K_SCALE, V_SCALE = 0.05, 0.02  # not 1.0: a kernel that forgets a scale is off by 20-50x
# e4m3 keeps 3 mantissa bits: a round trip is within 2^-4 of the value (normal range)
E4M3_REL = 2.0 ** -4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def paged_kv(lens: list[int], bs: int, hkv: int, d: int, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random float32 [NB, 2, BS, Hkv, D] cache and a [B, W] int32 table of scattered
    blocks whose unused tail entries point at other requests' blocks."""
    per_req = [-(-n // bs) for n in lens]
    num_blocks = sum(per_req) + 3
    cache = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens), max(per_req) + 2), generator=gen)
    start = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[start:start + n]
        start += n
    return cache, table.to(torch.int32)


def fp8_kv(lens: list[int], bs: int, hkv: int, d: int, gen: torch.Generator,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_kv's cache stored in float8 with K_SCALE and V_SCALE (values ~N(0, 1) * 0.1, so
    x / scale spans e4m3's normal range), and its block table."""
    kv, table = paged_kv(lens, bs, hkv, d, gen)
    out = torch.empty(kv.shape, dtype=FP8_DTYPE)
    out[:, 0] = to_cache(kv[:, 0] * 0.1, FP8_DTYPE, K_SCALE)
    out[:, 1] = to_cache(kv[:, 1] * 0.1, FP8_DTYPE, V_SCALE)
    return out.to(device), table.to(device)


def dequant(kv: torch.Tensor) -> torch.Tensor:
    """A float8 [NB, 2, BS, Hkv, D] cache as the float32 values it stands for."""
    return torch.stack([from_cache(kv[:, 0], K_SCALE), from_cache(kv[:, 1], V_SCALE)], 1)


# --- the torch side ---------------------------------------------------------------------

def test_round_trip_saturates_and_keeps_e4m3_precision():
    x = torch.tensor([0.3, -1.7, 2.5, 1000.0, -1e6, 0.0])
    stored = to_cache(x, FP8_DTYPE, 0.5)
    assert stored.dtype == FP8_DTYPE
    back = from_cache(stored, 0.5)
    assert back[3] == FP8_MAX * 0.5 and back[4] == -FP8_MAX * 0.5  # saturated, not NaN
    assert torch.allclose(back[[0, 1, 2, 5]], x[[0, 1, 2, 5]], rtol=E4M3_REL, atol=0)
    assert to_cache(x, torch.float32, 0.5).equal(x)  # a float cache has no scale


def test_store_kv_ref_writes_scaled_entries(gen):
    kv = torch.zeros(3, 2, 4, 2, 16, dtype=FP8_DTYPE)
    k = torch.randn(5, 2, 16, generator=gen)
    v = torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([0, 5, -1, 11, 2])
    store_kv_ref(k, v, kv, slots, k_scale=K_SCALE * 10, v_scale=V_SCALE * 10)
    keep = slots >= 0
    got_k = from_cache(kv[slots[keep] // 4, 0, slots[keep] % 4], K_SCALE * 10)
    got_v = from_cache(kv[slots[keep] // 4, 1, slots[keep] % 4], V_SCALE * 10)
    assert torch.allclose(got_k, k[keep], rtol=E4M3_REL, atol=K_SCALE * 10 * 2 ** -9)
    assert torch.allclose(got_v, v[keep], rtol=E4M3_REL, atol=V_SCALE * 10 * 2 ** -9)
    assert not from_cache(kv[1, :, 3], 1.0).any()  # slot 7 was not written


def test_attention_refs_read_through_the_scales(gen):
    lens = [1, 16, 37]
    kv, table = fp8_kv(lens, 16, 2, 32, gen, torch.device("cpu"))
    full = dequant(kv)
    q = torch.randn(3, 4, 32, generator=gen)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = decode_attention_ref(q, kv, table, seq, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    want = decode_attention_ref(q, full, table, seq, 0.2)
    assert torch.allclose(got, want, atol=1e-6)
    cu = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
    qp = torch.randn(9, 4, 32, generator=gen)
    got = prefill_attention_ref(qp, kv, table, cu, seq, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    want = prefill_attention_ref(qp, full, table, cu, seq, 0.2)
    assert torch.allclose(got, want, atol=1e-6)


def test_mla_ref_reads_through_the_scale(gen):
    lat = torch.randn(4, 1, 8, 1, 48, generator=gen) * 0.1
    cache = to_cache(lat, FP8_DTYPE, K_SCALE)
    q = torch.randn(2, 4, 48, generator=gen)
    table = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
    seq = torch.tensor([11, 16], dtype=torch.int32)
    got = mla_decode_ref(q, cache, table, seq, 0.3, 32, kv_scale=K_SCALE)
    want = mla_decode_ref(q, from_cache(cache, K_SCALE), table, seq, 0.3, 32)
    assert torch.allclose(got, want, atol=1e-6)
    rows = torch.randn(3, 48, generator=gen)
    store_latent_ref(rows, cache, torch.tensor([1, -1, 30]), scale=K_SCALE)
    assert torch.allclose(from_cache(cache[[0, 3], 0, [1, 6], 0], K_SCALE), rows[[0, 2]],
                          rtol=E4M3_REL, atol=K_SCALE * 2 ** -9)


def test_block_scatter_moves_fp8_bytes():
    cache = torch.zeros(4, 2, 3, dtype=FP8_DTYPE)
    src = to_cache(torch.arange(12.0).view(2, 2, 3), FP8_DTYPE, 1.0)
    scatter_blocks_ref(src, cache, torch.tensor([3, 1]))
    assert from_cache(cache[3], 1.0).equal(torch.arange(6.0).view(2, 3))
    assert from_cache(cache[1], 1.0).equal(torch.arange(6.0, 12.0).view(2, 3))


# --- Triton against the references ---------------------------------------------------------

def _same_entries(a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """Two float8 caches hold the same values. On the GPU the cast rounds to nearest even as
    torch's does (bit-equal but for the odd double rounding through bf16). Triton's CPU
    interpreter drops the carry when rounding overflows the mantissa (1.99 -> 1.0, not
    2.0: ~3% of values), so there the rest must be within that factor of two."""
    a, b = a.cpu(), b.cpu()
    same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()
    assert same > (0.999 if HAS_CUDA else 0.9), same
    fa, fb = from_cache(a, scale), from_cache(b, scale)
    assert torch.isfinite(fa).all()
    assert torch.allclose(fa, fb, rtol=0.51, atol=scale * 2 ** -8)


def test_triton_store_kv_fp8(gen, device):
    from kernels.triton_store_kv import store_kv

    k = torch.randn(6, 2, 16, generator=gen) * 0.2
    v = torch.randn(6, 2, 16, generator=gen) * 0.2
    k[0, 0, 0] = 1e4  # saturates
    slots = torch.tensor([0, 5, -1, 11, 2, 9])
    want = torch.zeros(3, 2, 4, 2, 16, dtype=FP8_DTYPE)
    store_kv_ref(k, v, want, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    got = torch.zeros_like(want).to(device)
    store_kv(k.to(device), v.to(device), got, slots.to(device), k_scale=K_SCALE,
             v_scale=V_SCALE)
    got = got.cpu()
    assert from_cache(got[0, 0, 0, 0, 0], 1.0) == FP8_MAX
    _same_entries(got[:, 0], want[:, 0], K_SCALE)
    _same_entries(got[:, 1], want[:, 1], V_SCALE)


def test_triton_rope_store_kv_fp8(gen, device):
    from engine.rope import cos_sin_table
    from kernels.triton_rope_kv import rope_store_kv

    t, hq, hkv, d = 5, 4, 2, 16
    q, k, v = (torch.randn(t, h, d, generator=gen) * 0.2 for h in (hq, hkv, hkv))
    pos = torch.tensor([0, 3, 7, 8, 20])
    cs = cos_sin_table(d, 32, 10000.0, None)
    slots = torch.tensor([1, 4, -1, 10, 7])
    want = torch.zeros(3, 2, 4, hkv, d, dtype=FP8_DTYPE)
    q_want = rope_store_kv_ref(q, k, v, pos, cs, want, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    got = torch.zeros_like(want).to(device)
    q_got = rope_store_kv(q.to(device), k.to(device), v.to(device), pos.to(device),
                          cs.to(device), got, slots.to(device), k_scale=K_SCALE,
                          v_scale=V_SCALE)
    assert torch.allclose(q_got.cpu(), q_want, atol=1e-6)
    _same_entries(got.cpu()[:, 0], want[:, 0], K_SCALE)
    _same_entries(got.cpu()[:, 1], want[:, 1], V_SCALE)


def _decode_fp8(lens: list[int], hkv: int, g: int, d: int, qdtype: torch.dtype,
                gen: torch.Generator, device: torch.device, tol: float, **kw: int) -> None:
    from kernels.triton_decode_attention import decode_attention

    kv, table = fp8_kv(lens, 16, hkv, d, gen, device)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(device=device, dtype=qdtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    out = decode_attention(q, kv, table, seq, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
                           **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


def _prefill_fp8(reqs: list[tuple[int, int]], hkv: int, g: int, d: int, qdtype: torch.dtype,
                 gen: torch.Generator, device: torch.device, tol: float, **kw: int) -> None:
    from kernels.triton_prefill_attention import prefill_attention

    lens = [c + n for c, n in reqs]
    kv, table = fp8_kv(lens, 16, hkv, d, gen, device)
    cu = torch.tensor([0] + [n for _, n in reqs]).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(int(cu[-1]), hkv * g, d, generator=gen).to(device=device, dtype=qdtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = prefill_attention_ref(q, kv, table, cu, seq, d ** -0.5, k_scale=K_SCALE,
                                v_scale=V_SCALE)
    out = prefill_attention(q, kv, table, cu, seq, d ** -0.5, k_scale=K_SCALE,
                            v_scale=V_SCALE, **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_fp8(num_splits, gen, device):
    _decode_fp8([1, 16, 48, 37], 2, 2, 32, torch.float32, gen, device, 1e-4,
                num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("fused", [True, False])
def test_triton_decode_fp8_merges_the_splits_a_request_sized_for_itself(fused, gen, device):
    """A 1,024-token table in 8 splits of at least 64 tokens (64-token float8 tiles): 520
    tokens size their own splits at 128 (65 rounded up to the tile), so 5 splits hold
    tokens, which the merge must count (not ceil(520 / 64) clipped to 8: then the fused
    merge waits for splits that never come and leaves the output unwritten)."""
    import kernels.triton_decode_attention as tda
    from kernels.triton_decode_attention import decode_attention, min_split_tokens

    assert min_split_tokens(3, 1) == 64  # else the two counts may agree
    lens = [520, 30, 1]
    kv, table = fp8_kv(lens, 16, 1, 32, gen, device)
    table = torch.cat([table, table.new_zeros(len(lens), 64 - table.shape[1])], dim=1)
    q = torch.randn(len(lens), 2, 32, generator=gen).to(device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, table, seq, 0.2, out=out, k_scale=K_SCALE, v_scale=V_SCALE,
                     num_splits=8, fused_merge=fused)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)
    if fused:  # and every pair's counter back at zero for the next launch
        assert int(tda._counters[q.device].count_nonzero()) == 0


def test_triton_prefill_fp8(gen, device):
    _prefill_fp8([(0, 20), (16, 5), (3, 1)], 2, 2, 32, torch.float32, gen, device, 1e-4,
                 block_m=16, block_n=16)


def test_triton_mla_fp8(gen, device):
    from kernels.triton_mla_decode import mla_decode
    from kernels.triton_store_kv import store_latent

    c, r = 32, 16
    rows = torch.randn(40, c + r, generator=gen) * 0.2
    slots = torch.randperm(6 * 8, generator=gen)[:40]
    want = torch.zeros(6, 1, 8, 1, c + r, dtype=FP8_DTYPE)
    store_latent_ref(rows, want, slots, scale=K_SCALE)
    cache = torch.zeros_like(want).to(device)
    store_latent(rows.to(device), cache, slots.to(device), scale=K_SCALE)
    _same_entries(cache.cpu(), want, K_SCALE)
    q = torch.randn(2, 4, c + r, generator=gen).to(device)
    table = torch.tensor([[0, 2, 4], [5, 1, 3]], dtype=torch.int32, device=device)
    seq = torch.tensor([23, 9], dtype=torch.int32, device=device)
    ref = mla_decode_ref(q, cache, table, seq, 0.3, c, kv_scale=K_SCALE)
    out = mla_decode(q, cache, table, seq, 0.3, c, kv_scale=K_SCALE, num_splits=2, block_n=16)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)


# --- GPU, real sizes: bf16 queries over a float8 cache ---------------------------------

@pytest.mark.parametrize("batch,max_len", [(32, 4096), (4, 32768), (256, 1024)])
@pytest.mark.gpu
@needs_cuda
def test_decode_fp8_gpu(batch, max_len, gen):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    _decode_fp8(lens, 8, 4, 128, torch.bfloat16, gen, torch.device("cuda"), 1.2e-2)


@pytest.mark.gpu
@needs_cuda
def test_decode_fp8_gpu_query_past_fp16_range(gen):
    """fp16 products over a float8 cache take bf16 queries past fp16's range (65504) without
    an inf: a query component of 1e6 picks the keys whose component is largest, clamped or
    not (the other components are noise beside it), as the reference does."""
    from kernels.triton_decode_attention import decode_attention

    dev = torch.device("cuda")
    lens = [300, 77]
    kv, table = fp8_kv(lens, 16, 2, 64, gen, dev)
    q = torch.randn(2, 4, 64, generator=gen)
    q[0, 1, 0] = 1e6
    q = q.to(device=dev, dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = decode_attention_ref(q, kv, table, seq, 64 ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    out = decode_attention(q, kv, table, seq, 64 ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1.2e-2, rel_err(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_prefill_fp8_gpu(gen):
    _prefill_fp8([(0, 1000), (3000, 512), (17, 1), (0, 4096)], 8, 4, 128, torch.bfloat16, gen,
                 torch.device("cuda"), 1.2e-2)


@pytest.mark.gpu
@needs_cuda
def test_mla_fp8_gpu(gen):
    from kernels.triton_mla_decode import mla_decode

    c, r, bs, batch, ctx = 512, 64, 16, 32, 4096
    nb = batch * ctx // bs
    dev = torch.device("cuda")
    cache = to_cache(torch.randn(nb, 1, bs, 1, c + r, generator=gen) * 0.1, FP8_DTYPE,
                     K_SCALE).to(dev)
    table = torch.randperm(nb, generator=gen).view(batch, -1).to(dev, torch.int32)
    seq = torch.randint(1, ctx + 1, (batch,), generator=gen).to(dev, torch.int32)
    q = torch.randn(batch, 16, c + r, generator=gen).to(dev, torch.bfloat16)
    ref = mla_decode_ref(q, cache, table, seq, 0.07, c, kv_scale=K_SCALE)
    out = mla_decode(q, cache, table, seq, 0.07, c, kv_scale=K_SCALE)
    assert rel_err(out, ref) < 1.2e-2, rel_err(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_store_kv_fp8_gpu_rounds_as_torch(gen):
    from engine.rope import cos_sin_table
    from kernels.triton_rope_kv import rope_store_kv

    dev = torch.device("cuda")
    t, hq, hkv, d = 300, 32, 8, 128
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dev, torch.bfloat16)
               for h in (hq, hkv, hkv))
    pos = torch.arange(t, device=dev)
    cs = cos_sin_table(d, 512, 500000.0, None).to(dev)
    slots = torch.randperm(64 * 16, generator=gen)[:t].to(dev)
    want = torch.zeros(64, 2, 16, hkv, d, dtype=FP8_DTYPE, device=dev)
    rope_store_kv_ref(q, k, v, pos, cs, want, slots, k_scale=0.5, v_scale=0.25)
    got = torch.zeros_like(want)
    rope_store_kv(q, k, v, pos, cs, got, slots, k_scale=0.5, v_scale=0.25)
    same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_engine_triton_close_to_reference(tmp_path, dtype):
    """The engine on the GPU with a float8 pool (Triton kernels, CUDA graphs, split-K)
    against the same engine with the torch references, both reading float8 entries:
    teacher-forced logits over the reference's greedy sequences are close (the prefill
    kernels), the first tokens equal, and free-running greedy tokens mostly (decode; the
    dummy weights' flat logits let a rounding flip a near-tie)."""
    import json

    from kv_probe import prompt_logits

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (32, 45, 1, 700)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llms = {ref: LLM(str(tmp_path), load_format="dummy", device="cuda", dtype=dtype,
                     kv_cache_dtype="fp8", max_num_batched_tokens=256,
                     extra={"reference_kernels": ref}) for ref in (True, False)}
    try:
        assert all(llm.engine.kv_cache.dtype == FP8_DTYPE for llm in llms.values())
        tokens = {ref: [c.token_ids for c in llm.generate(prompts, params)]
                  for ref, llm in llms.items()}
        for p, t in zip(prompts, tokens[True], strict=True):
            got, want = prompt_logits(llms[False], p + t), prompt_logits(llms[True], p + t)
            assert rel_err(got, want) < 2e-2, rel_err(got, want)
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    finally:
        for llm in llms.values():
            llm.close()
    assert [t[0] for t in tokens[False]] == [t[0] for t in tokens[True]]
    same = sum(a == b for t, r in zip(tokens[False], tokens[True], strict=True)
               for a, b in zip(t, r, strict=True))
    assert same >= 0.75 * 4 * 24, (tokens[False], tokens[True])


def test_take_from_a_float_pool_is_one_index_op():
    # The reference decode reads every layer's blocks through take(): a float pool's read
    # must dispatch the index alone (no byte views around it), and give the same values.
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels.kv_fp8 import take

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    pool = torch.randn(6, 2, 4, 3)
    idx = torch.tensor([4, 1])
    with Ops() as m:
        got = take(pool, (idx,))
    assert m.ops == ["aten.index.Tensor"]
    assert torch.equal(got, pool[idx])
    f8 = pool.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    got8 = take(f8, (idx,))
    assert got8.dtype == FP8_DTYPE and torch.equal(got8.view(torch.uint8),
                                                   f8.view(torch.uint8)[idx])
