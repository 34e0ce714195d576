"""The K-split FP8 x FP8 kernel compiles for an H200 (sm_90) without a GPU, at the tiles its
launcher picks for 17-256 rows, with no register spills below 128-row tiles (those spill
52 bytes in the epilogue, ptxas 2026-12-04; the bound guards against growth):
ptxas from Triton's wheel, in a child process (the interpreter, which the value tests use,
compiles nothing and has no FP8 product)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_fp8_split_gemm as sg

SIG = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
       "c_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
       "s_am": "i32", "s_asm": "i32", "s_bn": "i32", "s_bsn": "i32", "s_cs": "i32",
       "s_cm": "i32"}
for rows in (17, 64, 128, 256):
    bm = sg.block_m(rows)
    for out_ty in ("*fp32", "*bf16"):  # partials; the product
        out[f"{rows}/{out_ty}"] = spills(
            sg._split_gemm_kernel, dict(SIG, c_ptr=out_ty), dict(
                FP8_DOT=True, EVEN_K=True, PDL=True, LATE=sg.PDL_DEPENDENTS == "late",
                BLOCK_M=bm, BLOCK_N=sg.BLOCK_N, BLOCK_K=sg.BLOCK_K),
            num_warps=sg.NUM_WARPS, num_stages=sg.NUM_STAGES)
'''


@pytest.mark.slow
def test_split_gemm_compiles_for_sm90_without_spills() -> None:
    spills = spill_bytes(BODY)
    assert len(spills) == 8, sorted(spills)
    over = {k: v for k, v in spills.items() if v > (64 if k.split("/")[0] in ("128", "256") else 0)}
    assert over == {}, spills
