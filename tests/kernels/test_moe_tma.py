"""The fused MoE kernel's tensor-memory form (kernels/triton_moe_tma.py) against the torch
reference: its expert rows summed as fused_moe sums them (interpreter on CPU, GPU with -m
gpu). fused_moe's choice of it is tested with the grouped-GEMM form's, in
test_moe_grouped_gemm.py."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_moe import fused_moe_ref
from tests.kernels.test_moe import INTERP_BF16_TOL, _inputs

# the interpreter's small tiles: BLOCK_M a multiple of the gather's 16 rows; the down GEMM's
# own N and K tiles differ from gate/up's
SMALL = (16, 16, 16, 4, 1, 32, 16, 4, 1)


def _rows_summed(x, w13, w2, weights, ids, start, tiles):  # type: ignore[no-untyped-def]
    import kernels.triton_moe as m
    from kernels.triton_moe_tma import expert_rows

    ids = ids.contiguous()
    y = expert_rows(x, w13, w2, ids, start, tiles)
    assert y.shape == (ids.numel(), x.shape[1])
    out = torch.empty_like(x)
    m._sum_topk(y, ids, weights, out, start, w13.shape[0], False)
    return out


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "a row the sum reads was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("t,h,inter,e,k,start,e_local", [
    (40, 32, 48, 6, 2, 0, None),  # I not a multiple of the gate/up tile: masked columns
    (37, 48, 40, 8, 3, 0, None),  # H not a multiple of the down tile, nor of BLOCK_K
    (50, 32, 32, 8, 3, 4, 4),  # this rank holds experts 4-7: the others' pairs skipped
    (50, 32, 32, 8, 3, 0, 4),
])
def test_tma_form_equals_reference(t, h, inter, e, k, start, e_local, gen, device):
    from kernels.triton_moe_tma import Tiles

    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, torch.bfloat16, gen, device, e_local)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, start)
    out = _rows_summed(x, w13, w2, weights, ids, start, Tiles(*SMALL))
    assert out.dtype == torch.bfloat16
    assert _err(out, ref) < INTERP_BF16_TOL


def test_tma_form_row_tiles_span_several_experts_runs(gen, device):
    # 60 tokens x top-2 over 3 experts: each expert's run is several 16-row tiles, and the
    # gather skips tiles past the runs (their rows are never read)
    from kernels.triton_moe_tma import Tiles

    x, w13, w2, weights, ids = _inputs(60, 32, 32, 3, 2, torch.bfloat16, gen, device)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, 0)
    assert _err(_rows_summed(x, w13, w2, weights, ids, 0, Tiles(*SMALL)), ref) \
        < INTERP_BF16_TOL
