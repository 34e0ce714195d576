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
# every GPU's entry ("<name> fp8" ones are read through their card's name below); a config
# that two entries share is compiled once, under the first one's name
gpus = [dev for dev in table if dev != "cpu" and not dev.endswith(" fp8")]
seen = set()
for dev, b in [(dev, b) for dev in gpus for b in table[dev]]:
    bucket = f"{dev}/{b}"
    # one token's tiles (PER_PAIR: no align step) come from the smallest bucket too
    smallest = b == min(table[dev], key=int)
    for (kind, (wty, scaled)), pp in [(w, pp) for w in WEIGHTS.items()
                                      for pp in ((False, True) if smallest else (False,))]:
        # FP8 experts read the device's "<name> fp8" entry where it has one (tile_config)
        c = table.get(f"{dev} fp8", table[dev])[b] if kind else table[dev][b]
        if (kind, pp, tuple(sorted(c.items()))) in seen:
            continue
        seen.add((kind, pp, tuple(sorted(c.items()))))
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
      "tw_ptr": "*fp32", "sc_ptr": "*fp32", "res_ptr": "*bf16", "nw_ptr": "*bf16",
      "normed_ptr": "*bf16", "count_ptr": "*i32", "H": "i32", "INTER": "i32", "TOP_K": "i32",
      "expert_start": "i32", "num_local": "i32", "s_a": "i32", "s_we": "i32", "s_wn": "i32",
      "s_o": "i32", "s_se": "i32", "s_sn": "i32", "s_r": "i32", "s_nm": "i32", "eps": "fp32"}
DIV_DS = ("a_ptr", "w_ptr", "out_ptr", "ids_ptr", "tw_ptr", "sc_ptr", "res_ptr", "nw_ptr",
          "normed_ptr", "count_ptr", "H", "INTER", "s_a", "s_we", "s_wn", "s_o", "s_r", "s_nm")
for kind, (wty, scaled) in WEIGHTS.items():
    gk = scaled["GROUP_K"]
    for even in (True, False) if gk == 1 else (True,):
        out[f"down_sum/{kind}even{int(even)}"] = spills(ds._down_sum_kernel, dict(
            DS, w_ptr=wty), dict(BLOCK_N=ds.BLOCK_N, BLOCK_K=min(ds.BLOCK_K, gk) if gk > 1
                                 else ds.BLOCK_K, EVEN_K=even, PDL=True,
                                 STAGES=ds.NUM_STAGES, NEXT_NORM=False, BLOCK_H=1, **scaled),
            divisible=DIV_DS, num_warps=ds.NUM_WARPS)
# with the next layer's norm (NEXT_NORM): bf16 and FP8 per channel at V2-Lite's H = 2048
# (I = 1408: the moved-back last tile) and V3's 7168 (I = 2048), at rms_norm's warps for
# the row as the launcher runs it (8 and 16). The PTX shows what the "last program done"
# argument rests on (kernels/triton_router_route.py's, tests/kernels/
# test_router_route_sm90.py): a barrier after the columns' stores, one gpu-scope acq_rel
# atomic, a barrier between it and the last program's row loads from L2 (.cg); and the
# row's sum of squares reduces in _rms_norm_kernel's register layout (the same order of
# additions: the same rstd bits).
import re
import kernels.triton_norm as tn

NORM_SIG = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "new_res_ptr": "*bf16", "scale_ptr": "*fp32", "s_x": "i32", "s_r": "i32",
            "s_o": "i32", "s_nr": "i32", "s_part": "i32", "H": "i32", "eps": "fp32"}


class Found:  # a count read at the end like spills' results
    def __init__(self, n):
        self.n = n

    def result(self):
        return self.n


def compiled(fn, sig, const, div, warps):
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    return triton.compile(ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}),
                                    constexprs=const, attrs=attrs),
                          target=TARGET, options=dict(num_warps=warps))


def row_reduces(k, block_h):
    """The layouts (their definitions) of a kernel's reductions over a [block_h] float32 row."""
    ir = k.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, flags=re.M))
    found = re.findall(r'"tt\.reduce"\(%\w+\).*?\}\) : \(tensor<' + str(block_h)
                       + r'xf32, (#\w+)>\)', ir, flags=re.S)
    return [layouts[f] for f in found]


def tile_reduces(k, tile):
    """The layouts of a kernel's reductions of `tile`, less their warps: a row's order of
    additions (its elements a thread, lanes a row) is what they leave."""
    ir = k.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ir, flags=re.M))
    found = re.findall(r'"tt\.reduce"\(%\w+\).*?\}\) : \(' + tile + r', (#\w+)>\)', ir,
                       flags=re.S)
    return [re.sub(r"warpsPerCTA = \[[\d, ]+\], ", "", layouts[f]) for f in found]


for h, inter in ((2048, 1408), (7168, 2048)):
    block_h = triton.next_power_of_2(h)
    warps = tn.norm_warps(block_h)
    norm = compiled(tn._rms_norm_kernel, NORM_SIG, dict(HAS_RES=True, BLOCK_H=block_h,
                    PARTS=0, PDL=True, QUANT=False),
                    [k for k in NORM_SIG if NORM_SIG[k].startswith("*") or k.startswith("s_")
                     or k == "H"], warps)
    for kind in ("", "fp8/"):
        wty, scaled = WEIGHTS[kind]
        key = f"down_sum_norm/{kind}{h}"
        const = dict(BLOCK_N=ds.BLOCK_N, BLOCK_K=ds.BLOCK_K, EVEN_K=inter % ds.BLOCK_K == 0,
                     PDL=True, STAGES=ds.NUM_STAGES, NEXT_NORM=True, BLOCK_H=block_h,
                     **scaled)
        sig = dict(DS, w_ptr=wty)
        out[key] = spills(ds._down_sum_kernel, sig, const, divisible=DIV_DS, num_warps=warps)
        k = compiled(ds._down_sum_kernel, sig, const, DIV_DS, warps)
        ptx = k.asm["ptx"]
        atoms = re.findall(r"atom\.[\w.]+", ptx)
        n_acq = sum(a in ("atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.acq_rel.add.s32")
                    for a in atoms)
        out[f"{key}/acq_rel_gpu_atoms"] = Found(n_acq)
        out[f"{key}/other_atoms"] = Found(len(atoms) - n_acq)
        before = ptx[:ptx.index("atom.")]
        out[f"{key}/barrier_before_atom"] = Found(int(
            before.rfind("bar.sync") > before.rfind("st.global")))
        after = ptx[ptx.index("atom."):]
        out[f"{key}/cg_loads"] = Found(after.count("ld.global.cg"))
        out[f"{key}/barrier_after_atom"] = Found(int(
            -1 < after.find("bar.sync") < after.find("ld.global.cg")))
        mine, theirs = row_reduces(k, block_h), row_reduces(norm, block_h)
        out[f"{key}/row_reduce_as_norm"] = Found(int(len(mine) == 1 and mine == theirs))
        # the weight tile's reduction over K in the layout of the 4-warp launch without
        # the norm: the same MoE row bits (the module docstring's table)
        plain = compiled(ds._down_sum_kernel, sig, dict(const, NEXT_NORM=False, BLOCK_H=1),
                         DIV_DS, ds.NUM_WARPS)
        tile = f"tensor<{ds.BLOCK_N}x{ds.BLOCK_K}xf32"
        out[f"{key}/tile_reduce_as_plain"] = Found(int(
            tile_reduces(k, tile) == tile_reduces(plain, tile) != []))
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
    # Every tile of the table, every card's entry included, compiles without spills as
    # launched (the divisibility above). Compiled without it, the H200's prefill tile
    # showed 452 bytes in gate/up: an unpipelined kernel that no launch at these shapes runs.
    spills = spill_bytes(BODY)
    # 2 * 22: gate/up and down for each distinct (weights, per-pair, tiles) of the table
    # (16 bucket configs over the three weight kinds, 6 per-pair ones); 5 each: down + sum,
    # and gate/up without tl.dot (bf16 and FP8 per channel, each with and without whole K
    # tiles; FP8 block scales); then align, route, the sum with and without the row map,
    # router; down + sum with the next norm (bf16 and FP8 per channel at H = 2048 and
    # 7168), each with its 7 findings
    norm = [k for k in spills if k.startswith("down_sum_norm/")]
    assert len(spills) - len(norm) == 2 * 22 + 5 + 5 + 5, sorted(spills)
    assert {k: v for k, v in spills.items() if v and k not in norm} == {}, spills
    assert len(norm) == 4 * 8, sorted(norm)
    for key in ("down_sum_norm/2048", "down_sum_norm/7168", "down_sum_norm/fp8/2048",
                "down_sum_norm/fp8/7168"):
        assert spills[key] == 0, (key, spills[key])
        assert spills[f"{key}/acq_rel_gpu_atoms"] == 1, spills
        assert spills[f"{key}/other_atoms"] == 0, spills
        assert spills[f"{key}/barrier_before_atom"] == 1, spills
        assert spills[f"{key}/barrier_after_atom"] == 1, spills
        assert spills[f"{key}/cg_loads"] >= 1, spills
        assert spills[f"{key}/row_reduce_as_norm"] == 1, spills
        # at rms_norm's warps (8, 16) the tile keeps its 4-warp layout but FP8's at 16
        assert spills[f"{key}/tile_reduce_as_plain"] == int(key != "down_sum_norm/fp8/7168"), (
            key, spills)
