"""The fused MoE kernels compile for an H200 (sm_90) without a GPU, and the tile table's
default configs need no register spills (the H200's tuned ones at most a measured few):
ptxas from Triton's wheel, in a child process (the kernel tests' conftest runs Triton in
its interpreter, which compiles nothing). The interpreter tests check values; this
catches what only the compiler sees."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_moe as m
import kernels.triton_moe_align as al

GU = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "N": "i32", "H": "i32", "INTER": "i32", "TOP_K": "i32",
      "s_x": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32"}
DN = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "tw_ptr": "*fp32", "N": "i32", "H": "i32", "INTER": "i32",
      "s_a": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32"}
table = json.load(open(m.CONFIG_FILE))["configs"]
for bucket, c in [(f"{dev}/{b}", c) for dev in ("default", "NVIDIA H200")
                  for b, c in table[dev].items()]:
    opts = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
    base = dict(BLOCK_M=c["BLOCK_M"], DOT_DTYPE=tl.bfloat16, IEEE=False, EVEN_K=True)
    out[f"gate_up/{bucket}"] = spills(m._gate_up_kernel, GU, dict(
        base, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"]), **opts)
    out[f"down/{bucket}"] = spills(m._down_kernel, DN, dict(
        base, BLOCK_N=c.get("BLOCK_N_DOWN", c["BLOCK_N"]),
        BLOCK_K=c.get("BLOCK_K_DOWN", c["BLOCK_K"])), **opts)
out["align/256"] = spills(al._align_kernel, {
    "ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "N": "i32", "P": "i32",
    "NUM_TILES": "i32", "expert_start": "i32", "num_local": "i32"},
    dict(BLOCK_E=256, CHUNK=al.ALIGN_CHUNK, BLOCK_M=16, BLOCK_T=64), num_warps=8)
out["route/256"] = spills(m._route_kernel, {
    "logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64",
    "E": "i32", "s_l": "i32", "scale": "fp32"},
    dict(TOP_K=8, BLOCK_E=256, BLOCK_K=8, SIGMOID=True, HAS_BIAS=True, RENORM=True,
         ROUND=True, ROUND_DTYPE=tl.bfloat16), num_warps=4)
out["sum"] = spills(m._sum_topk_kernel, {
    "y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16", "H": "i32", "TOP_K": "i32",
    "expert_start": "i32", "num_local": "i32", "s_y": "i32", "s_o": "i32"},
    dict(BLOCK_H=1024), num_warps=4)
'''


# the H200's decode tiles (BLOCK_N 128 x BLOCK_K 128) spill this little (bytes, per kernel)
# and are still the fastest measured there (kernels/moe_configs.json); more is a regression
H200_ACCEPTED = {"gate_up": 128, "down": 32}


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90_without_spills() -> None:
    spills = spill_bytes(BODY)
    assert len(spills) == 23
    over = {k: v for k, v in spills.items()
            if v > (H200_ACCEPTED[k.split("/")[0]] if "NVIDIA H200" in k else 0)}
    assert over == {}, spills
