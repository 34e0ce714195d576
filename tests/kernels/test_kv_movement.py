"""Triton store_kv / gather_blocks / scatter_blocks against the torch references.

These kernels only move (and for store_kv, possibly cast) elements, so results must match
the references exactly.
"""

from __future__ import annotations

import pytest
import torch

from kernels.ref_kv import gather_blocks_ref, scatter_blocks_ref, store_kv_ref

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cache(nb: int, layers: int, bs: int, hkv: int, d: int, dtype: torch.dtype,
           gen: torch.Generator, device: torch.device) -> torch.Tensor:
    # [NB, L, 2, BS, Hkv, D]: the engine's block-major layout, random (never zeros)
    return torch.randn(nb, layers, 2, bs, hkv, d, generator=gen).to(dtype=dtype, device=device)


def _store_case(nb, bs, hkv, d, t, dtype, gen, device, slot_dtype=torch.int64):
    from kernels.triton_store_kv import store_kv
    cache = _cache(nb, 3, bs, hkv, d, dtype, gen, device)
    key = torch.randn(t, hkv, d, generator=gen).to(dtype=dtype, device=device)
    value = torch.randn(t, hkv, d, generator=gen).to(dtype=dtype, device=device)
    slots = torch.randperm(nb * bs, generator=gen)[:t]  # distinct slots, scattered blocks
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(device=device, dtype=slot_dtype)
    expected = cache.clone()
    store_kv_ref(key, value, expected[:, 1], slots.long())
    store_kv(key, value, cache[:, 1], slots)
    assert torch.equal(cache, expected)  # also: no other layer or slot was touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkv,d", [(2, 64), (3, 128)])
def test_store_kv(dtype, hkv, d, gen, device):
    _store_case(nb=6, bs=16, hkv=hkv, d=d, t=37, dtype=dtype, gen=gen, device=device)


def test_store_kv_int32_slots_and_strided_key(gen, device):
    from kernels.triton_store_kv import store_kv
    cache = _cache(4, 2, 8, 2, 64, torch.float16, gen, device)
    qkv = torch.randn(10, 3, 2, 64, generator=gen).to(dtype=torch.float16, device=device)
    key, value = qkv[:, 1], qkv[:, 2]  # views into a fused qkv projection
    slots = torch.randperm(32, generator=gen)[:10].to(device=device, dtype=torch.int32)
    expected = cache.clone()
    store_kv_ref(key, value, expected[:, 0], slots.long())
    store_kv(key, value, cache[:, 0], slots)
    assert torch.equal(cache, expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_gpu(dtype, gen):
    _store_case(nb=4096, bs=16, hkv=8, d=128, t=8192, dtype=dtype, gen=gen,
                device=torch.device("cuda"))


def _blocks_case(nb, block_shape, n, dtype, gen, device, layer_view):
    from kernels.triton_blocks import gather_blocks, scatter_blocks
    cache = torch.randn(nb, *block_shape, generator=gen).to(dtype=dtype, device=device)
    if layer_view:  # [NB, 2, BS, Hkv, D] view of layer 1: dim 0 strided, block inner contiguous
        cache = cache[:, 1]
    ids = torch.randperm(nb, generator=gen)[:n].to(device)
    out = torch.full((n, *cache.shape[1:]), float("nan"), dtype=dtype, device=device)
    res = gather_blocks(cache, ids, out=out)
    assert res is out
    assert torch.equal(out, gather_blocks_ref(cache, ids))
    assert torch.equal(gather_blocks(cache, ids.int()), out)  # allocating path, int32 ids

    src = torch.randn(out.shape, generator=gen).to(dtype=dtype, device=device)
    expected = cache.clone()
    scatter_blocks_ref(src, expected, ids)
    scatter_blocks(src, cache, ids)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_view", [False, True])
def test_gather_scatter_blocks(dtype, layer_view, gen, device):
    # [L=3, 2, BS=4, Hkv=2, D=64] per block: 3072 elements, under one program's tile
    _blocks_case(9, (3, 2, 4, 2, 64), 5, dtype, gen, device, layer_view)


def test_gather_scatter_blocks_multi_tile(gen, device):
    # 2 * 2 * 16 * 2 * 128 = 16384 elements per block: several programs per block, one partial
    _blocks_case(5, (2, 2, 16, 2, 130), 3, torch.bfloat16, gen, device, False)


def test_blocks_reject_non_contiguous_block(device):
    from kernels.triton_blocks import gather_blocks
    cache = torch.zeros(4, 8, 6, device=device).transpose(1, 2)  # inner dims transposed
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(cache, torch.tensor([0, 1], device=device))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_blocks_gpu(dtype, gen):
    # Llama-3-8B, block size 16: 32 layers * 2 * 16 * 8 * 128 elements per block (2 MiB bf16)
    _blocks_case(300, (32, 2, 16, 8, 128), 100, dtype, gen, torch.device("cuda"), False)

