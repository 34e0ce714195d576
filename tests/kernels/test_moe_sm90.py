"""The fused MoE kernels compile for an H200 (sm_90) without a GPU, and none of the tile
table's configs needs register spills:
ptxas from Triton's wheel, in a child process (the kernel tests' conftest runs Triton in
its interpreter, which compiles nothing). The interpreter tests check values; this
catches what only the compiler sees."""

from __future__ import annotations

import pytest
from sm90_spills import spill_bytes

BODY = r'''
import kernels.triton_moe as m
import kernels.triton_moe_align as al
import kernels.triton_moe_down_sum as ds
import kernels.triton_moe_gate_up_gemv as gv
import kernels.triton_moe_route as rt
import kernels.triton_router_logits as rl

GU = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "sc_ptr": "*fp32", "ids_ptr": "*i64", "N": "i32", "H": "i32",
      "INTER": "i32", "TOP_K": "i32", "expert_start": "i32", "num_local": "i32",
      "s_x": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32", "s_se": "i32", "s_sn": "i32"}
DN = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "sc_ptr": "*fp32", "ids_ptr": "*i64", "N": "i32",
      "H": "i32", "INTER": "i32", "expert_start": "i32", "num_local": "i32", "s_a": "i32",
      "s_we": "i32", "s_wn": "i32", "s_o": "i32", "s_se": "i32", "s_sn": "i32"}
# What a launch at the supported models' shapes specializes on (hidden and intermediate
# sizes are multiples of 16: V2-Lite 2048/1408, Qwen3-30B-A3B 2048/768, Mixtral,
# DeepSeek-V3; fresh tensors are 16-byte aligned): without it the loads are neither
# vectorized nor pipelined, and ptxas reports spills of a kernel that never runs.
DIV_GU = ("x_ptr", "w_ptr", "out_ptr", "sorted_ptr", "bexp_ptr", "sc_ptr", "ids_ptr", "H",
          "INTER", "s_x", "s_we", "s_wn", "s_o")
DIV_DN = ("a_ptr", "w_ptr", "out_ptr", "sorted_ptr", "bexp_ptr", "sc_ptr", "ids_ptr", "H",
          "INTER", "s_a", "s_we", "s_wn", "s_o")
# weights: bf16; FP8 with per-channel scales; FP8 with 128-column block scales
WEIGHTS = {"": ("*bf16", dict(SCALED=False, GROUP_K=1, ONE_GROUP=True)),
           "fp8/": ("*fp8e4nv", dict(SCALED=True, GROUP_K=1, ONE_GROUP=True)),
           "fp8_block/": ("*fp8e4nv", dict(SCALED=True, GROUP_K=128, ONE_GROUP=False))}
table = json.load(open(m.CONFIG_FILE))["configs"]
for dev, b in [(dev, b) for dev in ("default", "NVIDIA H200") for b in table[dev]]:
    bucket = f"{dev}/{b}"
    # one token's tiles (PER_PAIR: no align step) come from the smallest bucket too
    smallest = b == min(table[dev], key=int)
    for (kind, (wty, scaled)), pp in [(w, pp) for w in WEIGHTS.items()
                                      for pp in ((False, True) if smallest else (False,))]:
        # FP8 experts read the device's "<name> fp8" entry where it has one (tile_config)
        c = table.get(f"{dev} fp8", table[dev])[b] if kind else table[dev][b]
        opts = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
        base = dict(BLOCK_M=c["BLOCK_M"], DOT_DTYPE=tl.bfloat16, IEEE=False, EVEN_K=True,
                    PDL=True, PER_PAIR=pp, **scaled)
        bn = c["BLOCK_N"]
        if scaled["GROUP_K"] > 1:  # the launcher's narrower tile for block scales
            bn = min(bn, max(16, m.BLOCK_SCALED_GATE_UP_TILE // c["BLOCK_M"]))
        tag = f"{kind}{bucket}{'/per_pair' if pp else ''}"
        out[f"gate_up/{tag}"] = spills(m._gate_up_kernel, dict(GU, w_ptr=wty), dict(
            base, BLOCK_N=bn, BLOCK_K=c["BLOCK_K"]), divisible=DIV_GU, **opts)
        out[f"down/{tag}"] = spills(m._down_kernel, dict(DN, w_ptr=wty), dict(
            base, BLOCK_N=c.get("BLOCK_N_DOWN", c["BLOCK_N"]),
            BLOCK_K=c.get("BLOCK_K_DOWN", c["BLOCK_K"])), divisible=DIV_DN, **opts)
# down + sum in one launch at one token, with its module's tiles: I a whole number of K
# tiles (Qwen3-30B-A3B's 768) or not (V2-Lite's 1408: the last tile moved back); block
# scales make I whole tiles of a group
DS = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
      "tw_ptr": "*fp32", "sc_ptr": "*fp32", "H": "i32", "INTER": "i32", "TOP_K": "i32",
      "expert_start": "i32", "num_local": "i32", "s_a": "i32", "s_we": "i32", "s_wn": "i32",
      "s_o": "i32", "s_se": "i32", "s_sn": "i32"}
DIV_DS = ("a_ptr", "w_ptr", "out_ptr", "ids_ptr", "tw_ptr", "sc_ptr", "H", "INTER", "s_a",
          "s_we", "s_wn", "s_o")
for kind, (wty, scaled) in WEIGHTS.items():
    gk = scaled["GROUP_K"]
    for even in (True, False) if gk == 1 else (True,):
        out[f"down_sum/{kind}even{int(even)}"] = spills(ds._down_sum_kernel, dict(
            DS, w_ptr=wty), dict(BLOCK_N=ds.BLOCK_N, BLOCK_K=min(ds.BLOCK_K, gk) if gk > 1
                                 else ds.BLOCK_K, EVEN_K=even, PDL=True,
                                 STAGES=ds.NUM_STAGES, **scaled),
            divisible=DIV_DS, num_warps=ds.NUM_WARPS)
# gate/up without tl.dot at one token, with its module's tiles: H a whole number of K
# tiles (V2-Lite's and Qwen3-30B-A3B's 2048) or not (the last tile moved back: no
# supported model's, compiled so a GPU run of one finds no spill either); block scales
# make H whole tiles of a group. H and I are runtime values, multiples of 16 as launched.
GV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
      "sc_ptr": "*fp32", "H": "i32", "INTER": "i32", "TOP_K": "i32", "expert_start": "i32",
      "num_local": "i32", "s_x": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32",
      "s_se": "i32", "s_sn": "i32"}
DIV_GV = ("x_ptr", "w_ptr", "out_ptr", "ids_ptr", "sc_ptr", "H", "INTER", "s_x", "s_we",
          "s_wn", "s_o")
for kind, (wty, scaled) in WEIGHTS.items():
    gk = scaled["GROUP_K"]
    for even in (True, False) if gk == 1 else (True,):
        out[f"gate_up_gemv/{kind}even{int(even)}"] = spills(gv._gate_up_gemv_kernel, dict(
            GV, w_ptr=wty), dict(BLOCK_N=gv.BLOCK_N, BLOCK_K=min(gv.BLOCK_K, gk) if gk > 1
                                 else gv.BLOCK_K, EVEN_K=even, PDL=True,
                                 STAGES=gv.NUM_STAGES, **scaled),
            divisible=DIV_GV, num_warps=gv.NUM_WARPS)
out["align/256"] = spills(al._align_kernel, {
    "ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "N": "i32", "P": "i32",
    "NUM_TILES": "i32", "expert_start": "i32", "num_local": "i32"},
    dict(BLOCK_E=256, CHUNK=al.ALIGN_CHUNK, BLOCK_M=16, BLOCK_T=64, PDL=True), num_warps=8)
out["route/256"] = spills(rt._route_kernel, {
    "logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64",
    "E": "i32", "s_l": "i32", "scale": "fp32"},
    # DeepSeek-V3's routing: 256 experts in 8 groups (top 4 groups), sigmoid + bias, top-8,
    # and its shared expert routed to as a 9th column
    dict(TOP_K=8, NUM_SHARED=1, BLOCK_E=256, BLOCK_K=16, SIGMOID=True, HAS_BIAS=True,
         RENORM=True, ROUND=True, ROUND_DTYPE=tl.bfloat16, N_GROUP=8, TOPK_GROUP=4,
         GROUP_SIZE=32, BLOCK_G=8, PDL=True), num_warps=4)
for has_map in (False, True):  # the grouped-GEMM form's rows read through the row map
    out[f"sum_map{int(has_map)}"] = spills(m._sum_topk_kernel, {
        "y_ptr": "*bf16", "ids_ptr": "*i64", "tw_ptr": "*fp32", "out_ptr": "*bf16",
        "map_ptr": "*i32", "H": "i32", "TOP_K": "i32", "expert_start": "i32",
        "num_local": "i32", "s_y": "i32", "s_o": "i32"},
        dict(BLOCK_H=1024, HAS_MAP=has_map, PDL=not has_map), num_warps=4)
out["router_logits"] = spills(rl._router_logits_kernel, {
    "x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "E": "i32", "H": "i32",
    "s_x": "i32", "s_w": "i32", "s_o": "i32"},
    dict(BLOCK_E=rl.BLOCK_E, BLOCK_K=rl.BLOCK_K, EVEN_K=True, PDL=True), num_warps=4)
'''


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90_without_spills() -> None:
    # Every tile of the table, the H200's tuned ones included, compiles without spills as
    # launched (the divisibility above). Compiled without it, the H200's prefill tile
    # showed 452 bytes in gate/up: an unpipelined kernel that no launch at these shapes runs.
    spills = spill_bytes(BODY)
    # 3 * 4: per-pair tiles; 5 each: down + sum, and gate/up without tl.dot (bf16 and FP8
    # per channel, each with and without whole K tiles; FP8 block scales); then align,
    # route, the sum with and without the row map, router
    assert len(spills) == 3 * 20 + 3 * 4 + 5 + 5 + 5, sorted(spills)
    assert {k: v for k, v in spills.items() if v} == {}, spills
