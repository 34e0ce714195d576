"""The weight-only FP8 GEMV with silu(gate) * up in its epilogue
(kernels/triton_fp8_weight_only.fp8_weight_only_glu) against the unfused pair it replaces,
silu_and_mul over fp8_weight_only's [gate | up] output with the same tiles: the same bits
(interpreter on CPU, the compiled kernel on a GPU), at 1-4 rows, per-channel and block
scales, a column tail that ends inside a program's tile, and masked K ranges; and where
the fused form refuses to run."""

from __future__ import annotations

import re

import pytest
import torch
from fp8_weights import fp8_weight

HAS_CUDA = torch.cuda.is_available()


def _dtype() -> torch.dtype:
    return torch.bfloat16 if HAS_CUDA else torch.float32


def _both(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    from kernels.triton_act import silu_and_mul
    from kernels.triton_fp8_weight_only import fp8_weight_only, fp8_weight_only_glu

    fused = fp8_weight_only_glu(x, w, s, config=cfg)
    unfused = silu_and_mul(fp8_weight_only(x, w, s, config=cfg))
    return fused, unfused


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [96, 80])  # inter 48: whole 16-column programs; 40: a tail
def test_glu_equals_gemv_then_activation(m, n, groups, gen, device):
    from kernels.triton_fp8_weight_only import Config

    w, s = fp8_weight(n, 512, groups, gen, device)
    x = torch.randn(m, 512, generator=gen).to(device=device, dtype=_dtype())
    fused, unfused = _both(x, w, s, Config("gemv", 32, 128, 4, 1))
    assert fused.shape == (m, n // 2) and fused.dtype == x.dtype
    assert torch.isfinite(fused).all(), "an element was not written"
    assert torch.equal(fused, unfused)
    assert fused.abs().sum() > 0


@pytest.mark.parametrize("block_n,block_k,stages", [(16, 256, 1), (64, 128, 2)])
def test_glu_tiles_and_masked_k(block_n, block_k, stages, gen, device):
    """Other tiles (pipelined and not), and K = 320: the last K tile is masked."""
    from kernels.triton_fp8_weight_only import Config

    for k in (512, 320):
        w, s = fp8_weight(72, k, 1, gen, device)
        x = torch.randn(2, k, generator=gen).to(device=device, dtype=_dtype())
        fused, unfused = _both(x, w, s, Config("gemv", block_n, block_k, 4, stages))
        assert torch.equal(fused, unfused), (k, block_n)


def test_glu_matches_the_activation_of_the_reference(gen, device):
    """Against the float reference, not the unfused kernels: silu(g) * u of
    ref_fp8.fp8_weight_only_ref's gate and up."""
    from kernels import ref_fp8
    from kernels.triton_fp8_weight_only import fp8_weight_only_glu

    w, s = fp8_weight(128, 256, 1, gen, device)
    x = torch.randn(3, 256, generator=gen).to(device=device, dtype=_dtype())
    ref = ref_fp8.fp8_weight_only_ref(x.float(), w, s).float()
    g, u = ref[:, :64], ref[:, 64:]
    want = torch.nn.functional.silu(g) * u
    got = fp8_weight_only_glu(x, w, s).float()
    err = float((got - want).norm() / want.norm())
    assert err < (2e-2 if x.dtype == torch.bfloat16 else 1e-5)


def test_glu_config_declines_split_and_dot_shapes():
    """The fused form needs whole sums in one program: no K split, GEMV rows only."""
    from kernels.triton_fp8_weight_only import GEMV_MAX_M, choose_splits, glu_config

    # 8B gate_up at 1 row on 132 SMs: unsplit, so fused
    assert choose_splits(1, 28672, 4096, 1, 132) == 1
    assert glu_config(1, 28672, 4096, 1, 132) is not None
    # a narrow layer that the grid rule splits along K: not fused
    assert choose_splits(1, 2048, 8192, 1, 132) > 1
    assert glu_config(1, 2048, 8192, 1, 132) is None
    assert glu_config(GEMV_MAX_M + 1, 28672, 4096, 1, 132) is None  # the dot kernel's rows
    assert glu_config(1, 28671, 4096, 1, 132) is None  # odd: not [gate | up]


def test_glu_refuses_bad_shapes_naming_them(gen, device):
    from kernels.triton_fp8_weight_only import DOT_CONFIG, fp8_weight_only_glu

    w, s = fp8_weight(96, 256, 1, gen, device)
    x = torch.randn(1, 256, generator=gen).to(device=device, dtype=_dtype())
    with pytest.raises(ValueError, match=re.escape("[gate | up]")):
        fp8_weight_only_glu(x, w[:95], s[:95])
    with pytest.raises(ValueError, match="config.kind"):
        fp8_weight_only_glu(x, w, s, config=DOT_CONFIG)
    with pytest.raises(ValueError, match="share K"):
        fp8_weight_only_glu(x[:, :128], w, s)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the compiled kernel at an 8B shape)")
@pytest.mark.parametrize("m", [1, 4])
def test_glu_at_the_8b_gate_up_shape_on_the_gpu(m, gen):
    """Llama-3-8B's gate_up (N = 2 x 14336, K = 4096) in bf16 with the default tiles
    (pipelined, evict-first at one row) that the engine's decode runs."""
    from kernels.triton_fp8_weight_only import auto_glu_config

    w, s = fp8_weight(28672, 4096, 1, gen, torch.device("cuda"))
    x = torch.randn(m, 4096, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    cfg = auto_glu_config(x, 28672, 1)
    assert cfg is not None
    fused, unfused = _both(x, w, s, cfg)
    assert torch.equal(fused, unfused)
