"""The transposed form of MLA decode compiles for an H200 (sm_90) without a GPU, at
DeepSeek's latent (512 + 64), 16 query heads, bf16 and fp16 caches, at its default
tiles: no register spills, and both products are warpgroup MMAs (what the form exists for:
were either left on mma.sync it would compile and run, as the pointer form does)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_mla_decode_t as m

for cache, dt, ty in (("bf16", "bf16", tl.bfloat16), ("fp16", "fp16", tl.float16)):
    sig = {"q_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "bt_ptr": "*i32", "lens_ptr": "*i32",
           "out_ptr": f"*{dt}", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "s_qb": "i32",
           "s_qh": "i32", "s_cb": "i64", "s_cs": "i32", "s_btb": "i32", "s_ob": "i32",
           "s_oh": "i32", "qk_scale": "fp32", "v_scale": "fp32", "split_len": "i32",
           "num_splits": "i32", "H": "i32"}
    const = dict(C=512, R=64, CP=512, RP=64, BLOCK_H=16, BS=16, BLOCK_N=m.BLOCK_N, SPLIT=True,
                 COMPUTE=ty, PREC=None, DYN=True, PDL=True)
    div = [k for k, v in sig.items() if v.startswith("*") or (k.startswith("s_") and k != "s_btb")]
    opts = dict(num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES)
    out[cache] = spills(m._mla_decode_t_kernel, sig, const, divisible=div, **opts)
    ptx = compiled(m._mla_decode_t_kernel, sig, const, div, **opts).asm["ptx"]
    out[cache + "/wgmma_only"] = Found(ptx, "wgmma.mma_async")
    out[cache + "/mma_sync"] = Found(ptx, "mma.sync")
'''


@pytest.mark.slow
def test_transposed_mla_decode_compiles_for_sm90_to_warpgroup_mma_without_spills() -> None:
    found = spill_bytes(BODY)
    assert found == {"bf16": 0, "bf16/wgmma_only": 1, "bf16/mma_sync": 0,
                     "fp16": 0, "fp16/wgmma_only": 1, "fp16/mma_sync": 0}, found
