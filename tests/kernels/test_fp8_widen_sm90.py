"""The GQA decode kernel over a float8 cache, compiled for an H200 (sm_90) without a GPU, with
its V widened as read (kernels/fp8_widen.py) and without: widened, the p @ V operand reads
no shared memory a byte at a time, and the loop spills no registers. Without it Triton 3.7
reads the float8 V tile with 128 ``ld.shared.b8`` per thread per tile (printed, not asserted:
that is the compiler's choice, which a later Triton may change)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_decode_attention as dec

SIG = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "bt_ptr": "*i32", "lens_ptr": "*i32",
       "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32",
       "s_qb": "i32", "s_qh": "i32", "s_cb": "i64", "s_ckv": "i32", "s_cs": "i32",
       "s_ch": "i32", "s_btb": "i32", "s_ob": "i32", "s_oh": "i32", "qk_scale": "fp32",
       "v_scale": "fp32", "split_len": "i32", "num_splits": "i32"}


class Count:  # a number the prelude's end reads as it reads ptxas' results
    def __init__(self, n):
        self.n = n

    def result(self):
        return self.n


for widen in (False, True):
    const = dict(G=4, BLOCK_G=16, D=128, BS=16, BLOCK_N=dec.FP8_BLOCK_N, SPLIT=True,
                 COMPUTE=tl.float16, IEEE=False, DYN=True, FUSED=True, G_PAD=4, MERGE_S=16,
                 ROUND=dec.FP8_BLOCK_N, CLAMP_Q=True, PDL=True, V_WIDEN=widen)
    opts = dict(num_warps=dec.FP8_NUM_WARPS, num_stages=dec.FP8_NUM_STAGES)
    out[f"spill/{widen}"] = spills(dec._decode_kernel, SIG, const, **opts)
    divisible = [k for k, v in SIG.items() if v.startswith("*") or
                 (k.startswith("s_") and k != "s_btb")]
    k = triton.compile(ASTSource(
        fn=dec._decode_kernel, signature=dict(SIG, **{n: "constexpr" for n in const}),
        constexprs=const,
        attrs={(dec._decode_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
               for n in divisible}), target=TARGET, options=opts)
    ptx = k.asm["ptx"]
    out[f"byte_reads/{widen}"] = Count(ptx.count("ld.shared.b8"))
    out[f"trans_reads/{widen}"] = Count(ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans"))
    out[f"widen_casts/{widen}"] = Count(ptx.count("cvt.rn.f16x2.e4m3x2"))
'''


@pytest.mark.slow
def test_widened_v_reads_no_shared_memory_a_byte_at_a_time() -> None:
    found = spill_bytes(BODY)
    print(found)
    assert found["byte_reads/True"] == 0, found
    # V's tile goes through shared memory as fp16, read back transposed as a 16-bit V is
    assert found["trans_reads/True"] > 0, found
    # both forms widen every K and V value once (two values per instruction)
    assert found["widen_casts/True"] == found["widen_casts/False"] > 0, found
    assert found["spill/True"] == 0 and found["spill/False"] == 0, found
