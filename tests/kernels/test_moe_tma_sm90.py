"""The fused MoE kernel's tensor-memory form compiles for an H200 (sm_90) without a GPU: at
its default tiles no register spills, and its operand tiles really are tensor-memory copies
feeding wgmma (what the form exists for: a fallback to per-element loads would compile and
run, slower). Compiled as launched: 16-divisible pointers, sizes and strides."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_moe_tma as m

bm, bn, bk = m.BLOCK_M, m.BLOCK_N, m.BLOCK_K
bn2, bk2 = m.BLOCK_N_DOWN, m.BLOCK_K_DOWN
GU = {"xs_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>",
      "act_ptr": "*bf16", "bexp_ptr": "*i32", "INTER": "i32", "H": "i32", "s_o": "i32"}
DN = {"act_desc": f"tensordesc<bf16[{bm}, {bk2}]>", "w_desc": f"tensordesc<bf16[{bn2}, {bk2}]>",
      "y_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "N": "i32", "H": "i32",
      "INTER": "i32", "s_y": "i32"}
for name, fn, sig, const, opts in [
        ("gate_up", m._gate_up_kernel, GU,
         dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=tl.bfloat16),
         dict(num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES,
              divisible=("act_ptr", "bexp_ptr", "INTER", "H", "s_o"))),
        ("down", m._down_kernel, DN,
         dict(BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, DOT_DTYPE=tl.bfloat16),
         dict(num_warps=m.NUM_WARPS_DOWN, num_stages=m.NUM_STAGES_DOWN,
              divisible=("y_ptr", "sorted_ptr", "bexp_ptr", "H", "INTER", "s_y")))]:
    out[name] = spills(fn, sig, const, **opts)
    out[name + "/tma_wgmma"] = Found(compiled(fn, sig, const, **opts).asm["ptx"],
                                     "cp.async.bulk.tensor", "wgmma.mma_async")
out["gather"] = spills(m._gather_kernel, {
    "x_ptr": "*bf16", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "xs_ptr": "*bf16", "N": "i32",
    "H": "i32", "TOP_K": "i32", "s_x": "i32", "s_xs": "i32"},
    dict(BLOCK_M=bm, BLOCK_R=m.GATHER_ROWS, BLOCK_H=m.GATHER_COLS),
    divisible=("x_ptr", "sorted_ptr", "bexp_ptr", "xs_ptr", "H", "s_x", "s_xs"), num_warps=4)
'''


@pytest.mark.slow
def test_tma_form_compiles_for_sm90_to_tensor_memory_copies_without_spills() -> None:
    found = spill_bytes(BODY)
    assert found == {"gate_up": 0, "down": 0, "gather": 0, "gate_up/tma_wgmma": 1,
                     "down/tma_wgmma": 1}, found
