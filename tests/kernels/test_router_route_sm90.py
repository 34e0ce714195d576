"""The fused router-logits + routing kernel (kernels/triton_router_route.py) compiles for an
H200 (sm_90) without a GPU and without spills, at DeepSeek-V2-Lite's and V3's routing
(ptxas from Triton's wheel in a child process: tests/sm90_spills.py). The PTX also shows
the ordering the kernel's "last program done" argument rests on, which only the compiler
sees: a barrier, then one gpu-scope acq_rel atomic, and the routing's loads from L2."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import re
import kernels.triton_router_route as rr
import kernels.triton_router_logits as rl

SIG = {"x_ptr": "*bf16", "rw_ptr": "*fp32", "logits_ptr": "*fp32", "count_ptr": "*i32",
       "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32", "H": "i32",
       "s_x": "i32", "s_rw": "i32", "s_l": "i32", "scale": "fp32"}
BASE = dict(TILE_E=rl.BLOCK_E, TILE_K=rl.BLOCK_K, EVEN_K=True, PDL=True)
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


for name, shape in SHAPES.items():
    const = dict(BASE, **shape)
    out[name] = spills(rr._router_route_kernel, SIG, const, num_warps=4)
    sig = dict(SIG, **{k: "constexpr" for k in const})
    ptx = triton.compile(ASTSource(fn=rr._router_route_kernel, signature=sig,
                                   constexprs=const), target=TARGET,
                         options=dict(num_warps=4)).asm["ptx"]
    atoms = re.findall(r"atom\.[\w.]+", ptx)
    out[f"{name}/acq_rel_gpu_atoms"] = Found(
        sum(a in ("atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.acq_rel.add.s32")
            for a in atoms))
    out[f"{name}/other_atoms"] = Found(len(atoms) - out[f"{name}/acq_rel_gpu_atoms"].n)
    # the barrier sits between the logits' stores and the atomic
    before = ptx[:ptx.index("atom.")]
    out[f"{name}/barrier_before_atom"] = Found(int(
        before.rfind("bar.sync") > before.rfind("st.global")))
    out[f"{name}/cg_loads"] = Found(ptx.count("ld.global.cg"))
    # and one between it and the last program's loads (the result's broadcast to all
    # threads), so every thread reads after the acquire
    after = ptx[ptx.index("atom."):]
    out[f"{name}/barrier_after_atom"] = Found(int(
        -1 < after.find("bar.sync") < after.find("ld.global.cg")))
'''


@pytest.mark.slow
def test_router_route_compiles_for_sm90_without_spills() -> None:
    found = spill_bytes(BODY)
    for name in ("v2_lite", "v3"):
        assert found[name] == 0, (name, found)
        assert found[f"{name}/acq_rel_gpu_atoms"] == 1, found
        assert found[f"{name}/other_atoms"] == 0, found
        assert found[f"{name}/barrier_before_atom"] == 1, found
        assert found[f"{name}/barrier_after_atom"] == 1, found
        assert found[f"{name}/cg_loads"] >= 1, found
