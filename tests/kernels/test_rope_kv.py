"""RoPE fused with the KV store against its torch reference (interpreter on CPU, GPU with
-m gpu): the rotated q, the cache slots written, and every other slot left alone."""

from __future__ import annotations

import pytest
import torch

from engine.rope import cos_sin_table
from kernels.ref_rope_kv import rope_store_kv_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(t, hq, hkv, d, dtype, gen, device, close, nb=8, bs=16, qk_norm=False):
    from kernels.triton_rope_kv import rope_store_kv

    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype=dtype, device=device)
    norm = None
    if qk_norm:  # Qwen3's per-head norms; weights away from 1 so that they matter
        qw = (1 + torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
        kw = (1 + torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
        norm = (qw, kw, 1e-6)
        qkv = qkv * 7  # the norm's output does not depend on the scale; the input's does
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]  # strided, as the model's
    positions = torch.randint(0, 1000, (t,), generator=gen).to(device)
    cs = cos_sin_table(d, 1000, 10000.0, None).to(device)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[::4] = -1  # padding rows store nothing
    slots = slots.to(device)
    # [NB, L, 2, BS, Hkv, D], layer 1 of 3: a strided layer view, as the engine's
    cache = torch.randn(nb, 3, 2, bs, hkv, d, generator=gen).to(dtype=dtype, device=device)
    expected = cache.clone()
    q_ref = rope_store_kv_ref(q, k, v, positions, cs, expected[:, 1], slots, qk_norm=norm)
    q_out = rope_store_kv(q, k, v, positions, cs, cache[:, 1], slots, qk_norm=norm)
    close(q_out, q_ref, dtype)
    close(cache, expected, dtype)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = ~written.view(nb, bs).to(device)
    assert torch.equal(cache[:, 0], expected[:, 0]) and torch.equal(cache[:, 2], expected[:, 2])
    for kv in (0, 1):  # slots not stored to keep their old bytes exactly
        assert torch.equal(cache[:, 1, kv][untouched], expected[:, 1, kv][untouched])
    # v is moved, not rotated: its slots hold v exactly
    keep = slots >= 0
    s = slots[keep]
    assert torch.equal(cache[s // bs, 1, 1, s % bs], v[keep])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 128), (3, 1, 64)])
def test_rope_store_kv(dtype, hq, hkv, d, gen, device, close):
    _case(9, hq, hkv, d, dtype, gen, device, close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 128)])
def test_rope_store_kv_with_qk_norm(dtype, hq, hkv, d, gen, device, close):
    _case(9, hq, hkv, d, dtype, gen, device, close, qk_norm=True)


def test_qk_norm_changes_q_and_k_as_the_separate_norms_would(gen):
    # the reference's qk_norm is exactly RMSNorm per head then the plain path: what the
    # model ran before the norms moved into the kernel (engine/models/llama.Attention)
    from kernels.ref_norm import rms_norm_ref

    t, hq, hkv, d = 5, 4, 2, 64
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(torch.bfloat16) * 3
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    qw = (1 + torch.randn(d, generator=gen)).bfloat16()
    kw = torch.randn(d, generator=gen).bfloat16()
    pos = torch.arange(t) * 3
    cs = cos_sin_table(d, 64, 10000.0, None)
    slots = torch.arange(t)
    fused = torch.zeros(2, 2, 16, hkv, d, dtype=torch.bfloat16)
    plain = torch.zeros_like(fused)
    q_fused = rope_store_kv_ref(q, k, v, pos, cs, fused, slots, qk_norm=(qw, kw, 1e-6))
    qn = rms_norm_ref(q.reshape(-1, d), qw, 1e-6)[0].view(t, hq, d)
    kn = rms_norm_ref(k.reshape(-1, d), kw, 1e-6)[0].view(t, hkv, d)
    q_plain = rope_store_kv_ref(qn, kn, v, pos, cs, plain, slots)
    assert torch.equal(q_fused, q_plain) and torch.equal(fused, plain)
    unnormed = torch.zeros_like(fused)
    assert not torch.equal(rope_store_kv_ref(q, k, v, pos, cs, unnormed, slots), q_fused)


def test_rope_store_kv_rejects_bad_shapes(device):
    from kernels.triton_rope_kv import rope_store_kv

    q = torch.zeros(2, 4, 64, device=device)
    k = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(4, 2, 16, 2, 64, device=device)
    cs = torch.zeros(10, 64, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store_kv(q, k, k, pos, cs, cache, pos[:1])
    with pytest.raises(ValueError, match="v"):
        rope_store_kv(q, k, q, pos, cs, cache, pos)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="qk_norm k weight"):
        rope_store_kv(q, k, k, pos, cs, cache, pos, qk_norm=(w, w[:32], 1e-6))
    with pytest.raises(ValueError, match="qk_norm q weight"):
        rope_store_kv(q, k, k, pos, cs, cache, pos,
                      qk_norm=(torch.ones(64, dtype=torch.int32, device=device), w, 1e-6))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_gpu(dtype, gen, close):
    _case(1024, 32, 8, 128, dtype, gen, torch.device("cuda"), close, nb=128, bs=16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_qk_norm_gpu(dtype, gen, close):
    # Qwen3-30B-A3B's heads (32 q, 4 kv, 128 dims), a prefill-sized step
    _case(1024, 32, 4, 128, dtype, gen, torch.device("cuda"), close, nb=128, bs=16,
          qk_norm=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_sums_a_k_split_projections_partials(dtype, parts, qk_norm, gen, device,
                                                           close):
    # q, k, v as views of [S, T, (Hq + 2 Hkv) D] float32 partials: the kernel sums them and
    # rounds to the model's dtype, then does what it does for that projection's output
    # (with qk_norm: the heads' norms on the rounded sums).
    from kernels.triton_rope_kv import rope_store_kv

    t, hq, hkv, d = 3, 4, 2, 64
    norm = None
    if qk_norm:
        norm = ((1 + torch.randn(d, generator=gen)).to(dtype=dtype, device=device),
                (1 + torch.randn(d, generator=gen)).to(dtype=dtype, device=device), 1e-6)
    qkv_p = torch.randn(parts, t, (hq + 2 * hkv) * d, generator=gen).to(device)
    whole = qkv_p.sum(0).to(dtype).view(t, hq + 2 * hkv, d)
    views = qkv_p.view(parts, t, hq + 2 * hkv, d)
    q, k, v = views[:, :, :hq], views[:, :, hq:hq + hkv], views[:, :, hq + hkv:]
    positions = torch.arange(5, 5 + t).to(device)
    cs = cos_sin_table(d, 64, 10000.0, None).to(device)
    slots = torch.tensor([3, 17, 30]).to(device)
    cache = torch.zeros(4, 2, 16, hkv, d, dtype=dtype, device=device)
    expected = cache.clone()
    q_ref = rope_store_kv_ref(whole[:, :hq], whole[:, hq:hq + hkv], whole[:, hq + hkv:],
                              positions, cs, expected, slots, qk_norm=norm)
    q_out = rope_store_kv(q, k, v, positions, cs, cache, slots, out_dtype=dtype, qk_norm=norm)
    assert q_out.dtype == dtype
    close(q_out, q_ref, dtype)
    close(cache, expected, dtype)
    cache2 = torch.zeros_like(cache)
    q_ref2 = rope_store_kv_ref(q, k, v, positions, cs, cache2, slots, out_dtype=dtype,
                               qk_norm=norm)
    assert torch.equal(q_ref2, q_ref) and torch.equal(cache2, expected)
    with pytest.raises(ValueError, match="out_dtype"):
        rope_store_kv(q, k, v, positions, cs, cache, slots)
