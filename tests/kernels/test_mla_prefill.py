"""Triton MLA prefill attention on the decompressed context against the torch reference; the
reference itself against plain attention on per-head keys [k_nope | k_pe] and values."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_mla_prefill import mla_prefill_ref
from kernels.tile_fit import Tiles

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(chunks: list[int], lens: list[int], heads: int, dn: int, r: int, dv: int,
            dtype: torch.dtype, gen: torch.Generator, device: torch.device, gap: int = 3):
    """Queries for each request's chunk, and each request's context as one run of rows of
    kv / k_pe, the runs apart by `gap` rows of other data (as whole blocks are)."""
    t = sum(chunks)
    starts, n = [], gap
    for length in lens:
        starts.append(n)
        n += length + gap
    q = torch.randn(t, heads, dn + r, generator=gen).to(dtype)  # one tensor: strided views
    kv = torch.randn(n, heads, dn + dv, generator=gen).to(dtype)
    lat = torch.randn(n, 7 + r, generator=gen).to(dtype)  # k_pe: a latent row's tail
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return (q.to(device)[..., :dn], q.to(device)[..., dn:], kv.to(device),
            lat.to(device)[:, 7:], torch.tensor(starts, device=device),
            cu.to(device), torch.tensor(lens, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_prefill_equals_the_reference(dtype, gen, device, close):
    from kernels.triton_mla_prefill import mla_prefill
    # a whole prompt; a chunk after 40 cached tokens; a one-token chunk; an empty chunk
    # (a request with nothing to prefill here); several query and key tiles each
    args = _inputs([37, 20, 1, 0], [37, 60, 9, 5], 3, 32, 16, 32, dtype, gen, device)
    ref = mla_prefill_ref(*args, 0.17)
    out = torch.full_like(ref, float("nan"))
    res = mla_prefill(*args, 0.17, out=out, tiles=Tiles(16, 16, 2, 4))
    assert res is out
    close(out[:58], ref[:58], dtype)


def test_mla_prefill_non_power_of_two_dims(gen, device, close):
    # DeepSeek-shaped tiny configs: Dn 24, R 8, Dv 20, padded inside the kernel
    from kernels.triton_mla_prefill import mla_prefill
    args = _inputs([19, 6], [19, 30], 2, 24, 8, 20, torch.float32, gen, device)
    ref = mla_prefill_ref(*args, 0.3)
    out = mla_prefill(*args, 0.3, tiles=Tiles(16, 16, 2, 4))
    assert out.shape == (25, 2, 20)
    close(out, ref, torch.float32)


def test_mla_prefill_default_tiles(gen, device, close):
    from kernels.triton_mla_prefill import mla_prefill
    args = _inputs([70], [70], 2, 32, 16, 32, torch.float32, gen, device)
    close(mla_prefill(*args, 0.2), mla_prefill_ref(*args, 0.2), torch.float32)


def test_mla_prefill_refuses_mismatched_inputs(gen, device):
    from kernels.triton_mla_prefill import mla_prefill
    qn, qp, kv, kpe, starts, cu, lens = _inputs([4], [4], 2, 16, 8, 16, torch.float32, gen,
                                                device)
    with pytest.raises(ValueError, match="k_pe"):
        mla_prefill(qn, qp, kv, kpe[:, :4], starts, cu, lens, 1.0)
    with pytest.raises(ValueError, match="kv: expected"):
        mla_prefill(qn, qp, kv[:, :1], kpe, starts, cu, lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mla_prefill(qn, qp, kv, kpe, starts, cu[:1], lens, 1.0)
    with pytest.raises(ValueError, match="kv: torch.float16"):
        mla_prefill(qn, qp, kv.half(), kpe, starts, cu, lens, 1.0)


def test_the_reference_is_attention_on_per_head_keys(gen):
    """[k_nope | k_pe] per head, values v, causal from the chunk's offset: plain softmax
    attention over explicit per-head keys gives the same."""
    qn, qp, kv, kpe, starts, cu, lens = _inputs([5], [12], 2, 8, 4, 6, torch.float64, gen,
                                                torch.device("cpu"))
    out = mla_prefill_ref(qn, qp, kv, kpe, starts, cu, lens, 0.5)
    s0 = int(starts[0])
    keys = torch.cat([kv[s0:s0 + 12, :, :8], kpe[s0:s0 + 12, None, :].expand(12, 2, 4)], -1)
    vals = kv[s0:s0 + 12, :, 8:]
    q = torch.cat([qn, qp], -1)  # [5, 2, 12]
    for i in range(5):
        pos = 7 + i  # 12 tokens, the chunk's 5 last
        for h in range(2):
            w = torch.softmax(keys[:pos + 1, h] @ q[i, h] * 0.5, 0)
            want = w @ vals[:pos + 1, h]
            assert torch.allclose(out[i, h], want, atol=1e-12), (i, h)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_prefill_deepseek_sizes(heads, dtype, gen, device, close):
    # DeepSeek's dims (nope 128, rope 64, value 128) at the launcher's default tiles: a long
    # prompt, a chunk after a cached context, a short one
    from kernels.triton_mla_prefill import mla_prefill
    args = _inputs([1500, 300, 7], [1500, 2348, 7], heads, 128, 64, 128, dtype, gen, device)
    close(mla_prefill(*args, 0.07), mla_prefill_ref(*args, 0.07), dtype)
