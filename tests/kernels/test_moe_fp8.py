"""The fused MoE kernel with FP8 experts (per-channel and block scales) against its torch
reference (interpreter on CPU, GPU with -m gpu): the same weight-only arithmetic as
kernels/ref_fp8, and close to the float experts of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_fp8 import FP8, dequant_stack, quantize_stack
from kernels.ref_moe import fused_moe_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# bf16 rounding of the gate/up outputs, the activation and each expert's output; the
# interpreter's float32 -> bf16 cast truncates (tests/kernels/test_moe.py measures 1.1-1.3%)
BF16_TOL = 2.5e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(t, h, inter, e, k, dtype, block, gen, device, e_local=None):  # type: ignore[no-untyped-def]
    e_local = e if e_local is None else e_local
    x = torch.randn(t, h, generator=gen).to(dtype=dtype, device=device)
    w13 = torch.randn(e_local, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e_local, h, inter, generator=gen) * inter**-0.5
    q13, s13 = quantize_stack(w13, block)
    q2, s2 = quantize_stack(w2, block)
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(device)
    weights = torch.rand(t, k, generator=gen).to(device)
    return (x, q13.to(device), q2.to(device), weights, ids, s13.to(device), s2.to(device))


def _case(t, h, inter, e, k, dtype, block, gen, device, e_local=None, start=0,
          config=None):  # type: ignore[no-untyped-def]
    from kernels.triton_moe import fused_moe

    x, q13, q2, weights, ids, s13, s2 = _inputs(t, h, inter, e, k, dtype, block, gen,
                                                device, e_local)
    out = fused_moe(x, q13, q2, weights, ids, start, config=config, w13_scale=s13,
                    w2_scale=s2)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    # the reference of the same FP8 arithmetic, in float32
    ref = fused_moe_ref(x.float(), q13, q2, weights, ids, start, w13_scale=s13,
                        w2_scale=s2)
    # and float experts holding the dequantized weights
    deq = fused_moe_ref(x.float(), dequant_stack(q13, s13), dequant_stack(q2, s2), weights,
                        ids, start)
    tol = 2e-5 if dtype == torch.float32 else BF16_TOL
    assert _rel(out, ref) < tol, _rel(out, ref)
    assert _rel(ref, deq) < 2e-5, _rel(ref, deq)
    assert ref.abs().sum() > 0
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 32, 48, 8, 2), (7, 64, 32, 4, 2)])
def test_fp8_experts_per_channel(t, h, inter, e, k, dtype, gen, device):
    _case(t, h, inter, e, k, dtype, None, gen, device)


@pytest.mark.parametrize("block", [(32, 32), (16, 16)])  # 16: a K tile under the config's
def test_fp8_experts_block_scales(block, gen, device):
    # H = I = 64: two or four column groups per row in each GEMM; 48 rows of w13's gate
    # half is one and a half 32-row blocks
    _case(9, 64, 64, 4, 2, torch.float32, block, gen, device)


def test_fp8_experts_block_scales_partial_row_block(gen, device):
    # I = 96 rows of 64-row blocks: the gate and up halves each end inside a block (the
    # checkpoint's scales are per projection); w2's K = 96 in three 32-column groups
    _case(6, 64, 96, 4, 3, torch.float32, (64, 32), gen, device)


@pytest.mark.parametrize("start", [0, 4])
def test_fp8_expert_shard_skips_other_ranks(start, gen, device):
    _case(9, 32, 32, 8, 3, torch.float32, None, gen, device, e_local=4, start=start)


@pytest.mark.parametrize("cfg", [
    {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_N_DOWN": 32, "BLOCK_K_DOWN": 16},
    # a 64 x 128 gate/up tile: narrowed to 64 columns for block scales
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_N_DOWN": 32, "BLOCK_K_DOWN": 32},
])
def test_fp8_experts_wide_tiles(cfg, gen, device):
    cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    _case(10, 64, 32, 4, 2, torch.float32, (32, 32), gen, device, config=cfg)


def test_quantize_stack_round_trip(gen):
    w = torch.randn(3, 40, 64, generator=gen)
    for block in (None, (32, 32)):
        q, s = quantize_stack(w, block)
        assert q.dtype == FP8 and s.dtype == torch.float32
        assert s.shape == ((3, 40, 1) if block is None else (3, 40, 2))
        # e4m3 keeps 3 mantissa bits: a relative error of a few percent at most
        assert _rel(dequant_stack(q, s), w) < 0.04


def test_fp8_experts_bad_arguments_are_refused(gen, device):
    from kernels.triton_moe import fused_moe

    x, q13, q2, weights, ids, s13, s2 = _inputs(2, 32, 32, 4, 2, torch.float32, None, gen,
                                                device)
    with pytest.raises(ValueError, match="w13_scale, w2_scale: FP8 experts need both"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="w13, w2: scales given, expected float8_e4m3fn"):
        fused_moe(x, q13.float(), q2.float(), weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w13, w2: expected x's dtype"):
        fused_moe(x, q13, q2, weights, ids)  # FP8 weights without their scales
    with pytest.raises(ValueError, match="w2_scale: expected float32"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2.double())
    with pytest.raises(ValueError, match=r"w13_scale: expected \[4, 64, G\]"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13[:, :32], w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale: 3 scale groups"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13,
                  w2_scale=s2.expand(4, 32, 3).contiguous())
    with pytest.raises(ValueError, match="w13_scale, w2_scale: FP8 experts need both"):
        fused_moe_ref(x, q13, q2, weights, ids, w2_scale=s2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("t", [1, 8, 128, 600])
def test_fp8_experts_gpu(t, block, gen):
    # Qwen3-30B-A3B's expert shape: 128 experts, top-8, hidden 2048, intermediate 768
    _case(t, 2048, 768, 128, 8, torch.bfloat16, block, gen, torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
def test_fp8_experts_gpu_expert_shard_and_graph(gen):
    """Half the experts on this rank, FP8 with block scales, from a captured CUDA graph."""
    from kernels.triton_moe import fused_moe

    dev = torch.device("cuda")
    x, q13, q2, weights, ids, s13, s2 = _inputs(16, 1024, 512, 64, 6, torch.bfloat16,
                                                (128, 128), gen, dev, e_local=32)
    kw = dict(w13_scale=s13, w2_scale=s2)
    fused_moe(x, q13, q2, weights, ids, 32, **kw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(x, q13, q2, weights, ids, 32, **kw)
    ids.copy_(torch.rand(16, 64, generator=gen).argsort(dim=1)[:, :6].to(dev))
    ref = fused_moe_ref(x.float(), q13, q2, weights, ids, 32, **kw)
    g.replay()
    assert _rel(out, ref) < BF16_TOL


def test_fp8_experts_read_the_devices_fp8_tiles(monkeypatch):
    import kernels.triton_moe as m

    tiles = {n: {"8": {"BLOCK_M": n}} for n in (1, 2, 3)}
    table = {"default": tiles[1], "meta": tiles[2], "meta fp8": tiles[3]}
    monkeypatch.setattr(m, "_config_table", lambda: table)
    meta = torch.device("meta")
    assert m.tile_config(4, meta, 1)["BLOCK_M"] == 3  # FP8: the fp8 entry
    assert m.tile_config(4, meta, 2)["BLOCK_M"] == 2  # bf16: the device's
    assert m.tile_config(4, meta, 4)["BLOCK_M"] == 1  # float32: the defaults
    del table["meta fp8"]
    assert m.tile_config(4, meta, 1)["BLOCK_M"] == 2  # no fp8 entry: the device's
