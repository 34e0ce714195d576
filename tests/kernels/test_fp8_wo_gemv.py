"""The weight-only FP8 kernels' launch paths against kernels/ref_fp8.fp8_weight_only_ref
(interpreter on CPU): the dot-free GEMV (1, 2 and 4 rows a program, evict-first or not,
unmasked whole-tile K ranges and masked partial ones, clamped column tails, pipelined
K loop), the tensor-core kernel with its float32 conversion and unmasked path, and the
pre-GEMV configuration the sweep times against. Shapes are small: each case runs in well
under a second in the interpreter."""

from __future__ import annotations

import pytest
import torch
from fp8_weights import fp8_weight, rel_err

from kernels import ref_fp8

HAS_CUDA = torch.cuda.is_available()


def _check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, splits: int, config=None
           ) -> None:
    from kernels.triton_fp8_weight_only import fp8_weight_only

    m, n = x.shape[0], w.shape[0]
    out = fp8_weight_only(x, w, s, splits=splits, config=config)
    ref = ref_fp8.fp8_weight_only_ref(x, w, s, splits=splits)
    assert out.shape == ((m, n) if splits == 1 else (splits, m, n))
    assert out.dtype == (x.dtype if splits == 1 else torch.float32)
    assert torch.isfinite(out).all(), "an element was not written"
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, ref) < tol
    if splits > 1:  # the partials add up to the whole product
        assert rel_err(out.sum(0), ref_fp8.fp8_weight_only_ref(x.float(), w, s)) < 1e-2


def _dtype() -> torch.dtype:
    return torch.bfloat16 if HAS_CUDA else torch.float32


@pytest.mark.parametrize("groups", [1, 4])  # per channel; 128-column blocks
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("splits", [1, 2])
def test_gemv_default_path(m, splits, groups, gen, device):
    """Rows up to GEMV_MAX_M take the GEMV: N=96 leaves a clamped half tile, K=512 in
    whole tiles (the unmasked path); 3 rows fill a 4-row program with a re-read row."""
    from kernels.triton_fp8_weight_only import GEMV_MAX_M, config_for

    assert m <= GEMV_MAX_M and config_for(m, 96, 512, groups).kind == "gemv"
    w, s = fp8_weight(96, 512, groups, gen, device)
    x = torch.randn(m, 512, generator=gen).to(device=device, dtype=_dtype())
    _check(x, w, s, splits)


@pytest.mark.parametrize("m,splits", [(1, 1), (3, 2), (6, 1)])
def test_gemv_k_not_whole_tiles(m, splits, gen, device):
    """K=320 per channel: ranges of 320 or 160 columns end inside a 128-column tile, so
    the masked K path runs (6 rows: two programs, the second half empty)."""
    from kernels.triton_fp8_weight_only import Config

    w, s = fp8_weight(40, 320, 1, gen, device)
    x = torch.randn(m, 320, generator=gen).to(device=device, dtype=_dtype())
    _check(x, w, s, splits, Config("gemv", 32, 128, 4, 1))


@pytest.mark.parametrize("block_n,block_k,stages", [(16, 256, 1), (32, 64, 3), (64, 128, 2)])
@pytest.mark.parametrize("groups", [1, 2])
def test_gemv_tiles(block_n, block_k, stages, groups, gen, device):
    """Sweep-style tiles, pipelined (stages > 1) and not, with block scales that span one
    or several tiles."""
    from kernels.triton_fp8_weight_only import Config

    w, s = fp8_weight(72, 512, groups, gen, device)
    x = torch.randn(1, 512, generator=gen).to(device=device, dtype=_dtype())
    _check(x, w, s, 2, Config("gemv", block_n, block_k, 4, stages))


@pytest.mark.parametrize("groups", [1, 4])
def test_gemv_16_rows_and_strided_x(groups, gen, device):
    """16 rows forced onto the GEMV: four programs of four rows sharing each tile (no
    evict-first), with x a column slice of a wider tensor (row stride > K)."""
    from kernels.triton_fp8_weight_only import Config

    w, s = fp8_weight(64, 512, groups, gen, device)
    wide = torch.randn(16, 640, generator=gen).to(device=device, dtype=_dtype())
    x = wide[:, 64:576]
    assert x.stride(0) == 640
    _check(x, w, s, 1, Config("gemv", 32, 128, 4, 1))


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("m,splits", [(16, 1), (16, 4), (5, 2)])
def test_dot_path_past_gemv_rows(m, splits, groups, gen, device):
    """Past GEMV_MAX_M rows: the tensor-core kernel, float32 conversion, unmasked K."""
    from kernels.triton_fp8_weight_only import config_for

    cfg = config_for(m, 96, 512, groups)
    assert cfg.kind == "dot" and cfg.cvt_f32 and cfg.even_k
    w, s = fp8_weight(96, 512, groups, gen, device)
    x = torch.randn(m, 512, generator=gen).to(device=device, dtype=_dtype())
    _check(x, w, s, splits)


@pytest.mark.parametrize("k,splits", [(512, 2), (320, 1)])
@pytest.mark.parametrize("which", ["old", "new"])
def test_dot_old_and_new_conversion(which, k, splits, gen, device):
    """The pre-GEMV configuration (masked K, FP8 straight to x's dtype) still runs, for
    the sweep; the new one's flags on a K that is not whole tiles fall back to masks."""
    from kernels.triton_fp8_weight_only import DOT_CONFIG, OLD_CONFIG

    w, s = fp8_weight(96, k, 1, gen, device)
    x = torch.randn(1, k, generator=gen).to(device=device, dtype=_dtype())
    _check(x, w, s, splits, OLD_CONFIG if which == "old" else DOT_CONFIG)


def test_config_table_picks_gemv_for_8b_decode_shapes():
    from kernels.triton_fp8_weight_only import config_for

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 4):
            cfg = config_for(m, n, k, 1)
            assert cfg.kind == "gemv" and k % cfg.block_k == 0, (m, n, k)
        assert config_for(16, n, k, 1).kind == "dot"


def test_bad_config_kind_is_refused(gen, device):
    from kernels.triton_fp8_weight_only import Config, fp8_weight_only

    w, s = fp8_weight(32, 256, 1, gen, device)
    with pytest.raises(ValueError, match="config.kind"):
        fp8_weight_only(torch.randn(1, 256, device=device), w, s,
                        config=Config("wgmma", 64, 128, 4, 1))


@pytest.mark.parametrize("entry", [0, 1, 2])
@pytest.mark.parametrize("groups", [1, 4])
def test_each_tuned_table_config(entry, groups, gen, device):
    """The tiles GEMV_TABLE launches on a GPU (the H200 sweep's), on a small shape: whole
    256-column tiles split in two, a partial column tile, 1 and 3 rows."""
    from kernels.triton_fp8_weight_only import GEMV_TABLE

    cfg = GEMV_TABLE[entry][2]
    w, s = fp8_weight(40, 1024, groups, gen, device)
    for m in (1, 3):
        x = torch.randn(m, 1024, generator=gen).to(device=device, dtype=_dtype())
        _check(x, w, s, 2, cfg)
