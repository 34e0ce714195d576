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


def _pairs_case(nb_src, nb_dst, words, n, gen, device):
    from kernels.triton_blocks import copy_block_pairs
    src = torch.randint(-2**62, 2**62, (nb_src, words), generator=gen).to(device)
    dst = torch.randint(-2**62, 2**62, (nb_dst, words), generator=gen).to(device)
    before = dst.clone()
    s = torch.randperm(nb_src, generator=gen)[:n]
    d = torch.randperm(nb_dst, generator=gen)[:n]
    copy_block_pairs(src, dst, torch.stack([s, d]).to(device), words)
    expected = before.clone()
    expected[d.to(device)] = src[s.to(device)]
    assert torch.equal(dst, expected)  # moved blocks exact, every other block untouched


@pytest.mark.parametrize("words", [8, 4096, 4096 * 2 + 24])  # one partial / exact / several tiles
def test_copy_block_pairs(words, gen, device):
    _pairs_case(7, 9, words, 5, gen, device)


def test_copy_block_pairs_takes_a_raw_pointer_and_checks_args(gen, device):
    from kernels.triton_blocks import copy_block_pairs
    with pytest.raises(ValueError, match="int64"):
        copy_block_pairs(torch.zeros(2, 8, device=device), torch.zeros(2, 8, device=device,
                         dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64,
                                                         device=device), 8)
    with pytest.raises(ValueError, match=r"\[2, N\]"):
        t = torch.zeros(2, 8, dtype=torch.int64, device=device)
        copy_block_pairs(t, t, torch.zeros(3, dtype=torch.int64, device=device), 8)


@pytest.mark.gpu
@needs_cuda
def test_copy_block_pairs_gpu_raw_pointer(gen):
    # what the ipc plane passes: no tensor for the source, only its address and word type
    from kernels.triton_blocks import copy_block_pairs

    class Ptr:
        dtype = torch.int64

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def data_ptr(self) -> int:
            return self.t.data_ptr()

    dev = torch.device("cuda")
    src = torch.randint(-2**62, 2**62, (64, 262144), generator=gen).to(dev)  # 2 MiB blocks
    dst = torch.zeros(80, 262144, dtype=torch.int64, device=dev)
    s, d = torch.randperm(64, generator=gen)[:40], torch.randperm(80, generator=gen)[:40]
    copy_block_pairs(Ptr(src), dst, torch.stack([s, d]).to(dev), 262144)
    assert torch.equal(dst[d.to(dev)], src[s.to(dev)])
    rest = sorted(set(range(80)) - set(d.tolist()))
    assert bool((dst[rest] == 0).all())
