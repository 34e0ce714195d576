"""The transposed form of float8 GQA decode compiles for an H200 (sm_90) without a GPU, at
Llama-3-8B's heads (a group of 4 padded to 16 query columns, head size 128), bf16 queries
(fp16 products, as the launcher runs them), unsplit and split with the fused merge, at its
default tiles: no register spills, and both products are warpgroup MMAs (what the form
exists for: were either left on mma.sync it would compile and run, as the pointer form
does)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_decode_attention_t as t

sig = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "bt_ptr": "*i32", "lens_ptr": "*i32",
       "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32",
       "s_qb": "i32", "s_qh": "i32", "s_cb": "i64", "s_ckv": "i32", "s_cs": "i32",
       "s_ch": "i32", "s_btb": "i32", "s_ob": "i32", "s_oh": "i32", "qk_scale": "fp32",
       "v_scale": "fp32", "split_len": "i32", "num_splits": "i32"}
div = [k for k, v in sig.items() if v.startswith("*") or (k.startswith("s_") and k != "s_btb")]
opts = dict(num_warps=t.NUM_WARPS, num_stages=t.NUM_STAGES)
for split in (False, True):
    const = dict(G=4, BLOCK_G=16, D=128, BS=16, BLOCK_N=t.BLOCK_N, SPLIT=split,
                 COMPUTE=tl.float16, PREC=None, DYN=split, FUSED=split, G_PAD=4, MERGE_S=16,
                 ROUND=t.BLOCK_N, CLAMP_Q=True, PDL=True)
    name = f"split{int(split)}"
    out[name] = spills(t._decode_t_kernel, sig, const, divisible=div, **opts)
    ptx = compiled(t._decode_t_kernel, sig, const, div, **opts).asm["ptx"]
    out[name + "/wgmma"] = Found(ptx, "wgmma.mma_async")
    out[name + "/mma_sync"] = Found(ptx, "mma.sync")
'''


@pytest.mark.slow
def test_transposed_fp8_decode_compiles_for_sm90_to_warpgroup_mma_without_spills() -> None:
    found = spill_bytes(BODY)
    assert found == {"split0": 0, "split0/wgmma": 1, "split0/mma_sync": 0,
                     "split1": 0, "split1/wgmma": 1, "split1/mma_sync": 0}, found
