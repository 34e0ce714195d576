"""The fused router-logits + routing kernel (kernels/triton_router_route.py) compiles for an
H200 (sm_90) without a GPU and without spills, at DeepSeek-V2-Lite's and V3's routing
(ptxas from Triton's wheel in a child process: tests/sm90_spills.py). The PTX also shows
the ordering the kernel's "last program done" argument rests on, which only the compiler
sees: a barrier, then one gpu-scope acq_rel atomic, and the routing's loads from L2.
The PRENORM variant (the residual add + RMSNorm first, at rms_norm's warps for the row:
8 at V2-Lite's H = 2048, 16 at V3's 7168) too, and its row's sum of squares reduces in
_rms_norm_kernel's register layout: the same order of additions, so the same rstd bits
on the GPU as the norm kernel's (the interpreter cannot show this)."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import re
import kernels.triton_router_route as rr
import kernels.triton_norm as tn
import kernels.triton_router_logits as rl

SIG = {"x_ptr": "*bf16", "rw_ptr": "*fp32", "logits_ptr": "*fp32", "count_ptr": "*i32",
       "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64", "a_ptr": "*bf16",
       "res_ptr": "*bf16", "nw_ptr": "*bf16", "new_res_ptr": "*bf16", "E": "i32", "H": "i32",
       "s_x": "i32", "s_rw": "i32", "s_l": "i32", "s_a": "i32", "s_r": "i32", "s_nr": "i32",
       "s_part": "i32", "scale": "fp32", "eps": "fp32"}
NORM_SIG = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "new_res_ptr": "*bf16", "scale_ptr": "*fp32", "s_x": "i32", "s_r": "i32",
            "s_o": "i32", "s_nr": "i32", "s_part": "i32", "H": "i32", "eps": "fp32"}
BASE = dict(TILE_E=rl.BLOCK_E, TILE_K=rl.BLOCK_K, EVEN_K=True, PDL=True, PARTS=0)
HIDDEN = {"v2_lite": 2048, "v3": 7168}
SHAPES = {
    # V2-Lite: 64 experts, softmax, top-6, its 2 shared experts as columns 7 and 8
    "v2_lite": dict(TOP_K=6, NUM_SHARED=2, BLOCK_E=64, BLOCK_K=8, SIGMOID=False,
                    HAS_BIAS=False, RENORM=False, ROUND=False, ROUND_DTYPE=tl.float32,
                    N_GROUP=1, TOPK_GROUP=1, GROUP_SIZE=64, BLOCK_G=1),
    # V3: 256 experts in 8 groups (top 4), sigmoid + bias, top-8, its shared expert
    "v3": dict(TOP_K=8, NUM_SHARED=1, BLOCK_E=256, BLOCK_K=16, SIGMOID=True,
               HAS_BIAS=True, RENORM=True, ROUND=True, ROUND_DTYPE=tl.bfloat16,
               N_GROUP=8, TOPK_GROUP=4, GROUP_SIZE=32, BLOCK_G=8),
}


class Found:  # a count read at the end like spills' results
    def __init__(self, n):
        self.n = n

    def result(self):
        return self.n


def divisible(sig):
    """What a real launch's arguments are multiples of 16 in: pointers, strides, and at
    these shapes E and H (64 or 256, 2048 or 7168), which the JIT specializes on too."""
    return [k for k, v in sig.items() if v.startswith("*") or k.startswith("s_")
            or k in ("E", "H")]


def compiled(fn, sig, const, warps):
    div = divisible(sig)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    return triton.compile(ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}),
                                    constexprs=const, attrs=attrs),
                          target=TARGET, options=dict(num_warps=warps))


def row_reduces(k, block_h):
    """The layouts (their definitions, not their names) of a kernel's reductions over a
    [block_h] float32 row."""
    ir = k.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, flags=re.M))
    found = re.findall(r'"tt\.reduce"\(%\w+\).*?\}\) : \(tensor<' + str(block_h)
                       + r'xf32, (#\w+)>\)', ir, flags=re.S)
    return [layouts[f] for f in found]


for name, shape in SHAPES.items():
    for prenorm in (False, True):
        block_h = triton.next_power_of_2(HIDDEN[name]) if prenorm else 1
        warps = tn.norm_warps(block_h) if prenorm else 4  # the launcher's
        key = f"{name}/prenorm" if prenorm else name
        const = dict(BASE, PRENORM=prenorm, BLOCK_H=block_h, **shape)
        out[key] = spills(rr._router_route_kernel, SIG, const, divisible(SIG),
                          num_warps=warps)
        k = compiled(rr._router_route_kernel, SIG, const, warps)
        ptx = k.asm["ptx"]
        atoms = re.findall(r"atom\.[\w.]+", ptx)
        out[f"{key}/acq_rel_gpu_atoms"] = Found(
            sum(a in ("atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.acq_rel.add.s32")
                for a in atoms))
        out[f"{key}/other_atoms"] = Found(len(atoms) - out[f"{key}/acq_rel_gpu_atoms"].n)
        # the barrier sits between the logits' stores and the atomic
        before = ptx[:ptx.index("atom.")]
        out[f"{key}/barrier_before_atom"] = Found(int(
            before.rfind("bar.sync") > before.rfind("st.global")))
        out[f"{key}/cg_loads"] = Found(ptx.count("ld.global.cg"))
        # and one between it and the last program's loads (the result's broadcast to all
        # threads), so every thread reads after the acquire
        after = ptx[ptx.index("atom."):]
        out[f"{key}/barrier_after_atom"] = Found(int(
            -1 < after.find("bar.sync") < after.find("ld.global.cg")))
        if prenorm:
            # the normed row's last store (the last before the logits' own), then a
            # barrier, then the logits' first load (of that row, or of the router weight)
            rows = before[:before.rfind("st.global")]
            last = rows.rfind("st.global")
            out[f"{key}/barrier_after_row"] = Found(int(
                last > -1 and -1 < rows.find("bar.sync", last) < rows.find("ld.global", last)))
            norm = compiled(tn._rms_norm_kernel, NORM_SIG,
                            dict(HAS_RES=True, BLOCK_H=block_h, PARTS=0, PDL=True,
                                 QUANT=False), warps)
            mine, theirs = row_reduces(k, block_h), row_reduces(norm, block_h)
            out[f"{key}/row_reduce_as_norm"] = Found(int(len(mine) == 1 and mine == theirs))
            # a split-K o_proj's two float32 partials as the row's input (Qwen3-MoE's)
            out[f"{key}/parts"] = spills(rr._router_route_kernel, dict(SIG, a_ptr="*fp32"),
                                         dict(const, PARTS=2), divisible(SIG),
                                         num_warps=warps)
'''


@pytest.mark.slow
def test_router_route_compiles_for_sm90_without_spills() -> None:
    found = spill_bytes(BODY)
    for name in ("v2_lite", "v3", "v2_lite/prenorm", "v3/prenorm"):
        assert found[name] == 0, (name, found)
        assert found[f"{name}/acq_rel_gpu_atoms"] == 1, found
        assert found[f"{name}/other_atoms"] == 0, found
        assert found[f"{name}/barrier_before_atom"] == 1, found
        assert found[f"{name}/barrier_after_atom"] == 1, found
        assert found[f"{name}/cg_loads"] >= 1, found
    for name in ("v2_lite/prenorm", "v3/prenorm"):
        assert found[f"{name}/parts"] == 0, found
        assert found[f"{name}/barrier_after_row"] == 1, found
        assert found[f"{name}/row_reduce_as_norm"] == 1, found
