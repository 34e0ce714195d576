"""The copy-engine form of MLA decode compiles for an H200 (sm_90) without a GPU, at
DeepSeek's latent (512 + 64 in two 256-column boxes and one 64-column box) over 16- and
64-token pages (the latter in TILE_ROWS-row tiles), bf16 and float8 caches, at its default
tiles: no register spills, and its page loads really are tensor-memory copies (a fallback
to per-element loads would compile and run, slower: what the form exists to avoid)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_mla_decode_tma as m

cb = m.c_box(512)
for bs in (16, 64):
    for cache, dt in (("bf16", "bf16"), ("fp8", "fp8e4nv")):
        bn = m.tile_rows(bs)
        sig = {"q_ptr": "*bf16", "c_desc": f"tensordesc<{dt}[1, {bn}, {cb}]>",
               "r_desc": f"tensordesc<{dt}[1, {bn}, 64]>", "bt_ptr": "*i32",
               "lens_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
               "part_lse_ptr": "*fp32", "s_qb": "i32", "s_qh": "i32", "s_btb": "i32",
               "s_ob": "i32", "s_oh": "i32", "qk_scale": "fp32", "v_scale": "fp32",
               "split_len": "i32", "num_splits": "i32", "H": "i32"}
        const = dict(C=512, R=64, CB=cb, NBOX=512 // cb, BLOCK_H=16, BS=bs, BLOCK_N=bn, SPLIT=True,
                     COMPUTE=tl.bfloat16, PREC=None, DYN=True, PDL=True)
        div = ("q_ptr", "bt_ptr", "lens_ptr", "out_ptr", "part_o_ptr", "part_lse_ptr",
               "s_qb", "s_qh", "s_ob", "s_oh")
        opts = dict(num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES)
        name = f"bs{bs}/{cache}"
        out[name] = spills(m._mla_decode_tma_kernel, sig, const, divisible=div, **opts)
        out[name + "/tma"] = Found(
            compiled(m._mla_decode_tma_kernel, sig, const, div, **opts).asm["ptx"],
            "cp.async.bulk.tensor")
'''


@pytest.mark.slow
def test_tma_mla_decode_compiles_for_sm90_to_tensor_memory_copies_without_spills() -> None:
    found = spill_bytes(BODY)
    assert found == {f"bs{bs}/{c}{t}": int(bool(t)) for bs in (16, 64) for c in ("bf16", "fp8")
                     for t in ("", "/tma")}, found
