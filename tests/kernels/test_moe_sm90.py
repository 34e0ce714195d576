"""The fused MoE kernels compile for an H200 (sm_90) without a GPU, and the tile table's
default configs need no register spills: ptxas from Triton's wheel, in a child process
(the kernel tests' conftest runs Triton in its interpreter, which compiles nothing). The
interpreter tests check values; this catches what only the compiler sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import json, os, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.triton_moe as m
import kernels.triton_moe_align as al

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)


def compile_(fn, sig, const, **opts):
    sig = dict(sig, **{k: "constexpr" for k in const})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=TARGET,
                       options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True, check=True)
    os.unlink(f.name)
    spill = [l for l in r.stderr.splitlines() if "spill stores" in l][0]
    return int(spill.split("bytes spill stores")[0].split(",")[-1])


GU = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "N": "i32", "H": "i32", "INTER": "i32", "TOP_K": "i32",
      "s_x": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32"}
DN = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "tw_ptr": "*fp32", "N": "i32", "H": "i32", "INTER": "i32",
      "s_a": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32"}
out = {}
for bucket, c in json.load(open(m.CONFIG_FILE))["configs"]["default"].items():
    opts = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
    base = dict(BLOCK_M=c["BLOCK_M"], DOT_DTYPE=tl.bfloat16, IEEE=False, EVEN_K=True)
    out[f"gate_up/{bucket}"] = compile_(m._gate_up_kernel, GU, dict(
        base, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"]), **opts)
    out[f"down/{bucket}"] = compile_(m._down_kernel, DN, dict(
        base, BLOCK_N=c.get("BLOCK_N_DOWN", c["BLOCK_N"]),
        BLOCK_K=c.get("BLOCK_K_DOWN", c["BLOCK_K"])), **opts)
out["align/256"] = compile_(al._align_kernel, {
    "ids_ptr": "*i64", "sorted_ptr": "*i32", "bexp_ptr": "*i32", "N": "i32", "P": "i32",
    "NUM_TILES": "i32", "expert_start": "i32", "num_local": "i32"},
    dict(BLOCK_E=256, CHUNK=al.ALIGN_CHUNK, BLOCK_M=16, BLOCK_T=64), num_warps=8)
out["route/256"] = compile_(m._route_kernel, {
    "logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64",
    "E": "i32", "s_l": "i32", "scale": "fp32"},
    dict(TOP_K=8, BLOCK_E=256, BLOCK_K=8, SIGMOID=True, HAS_BIAS=True, RENORM=True,
         ROUND=True, ROUND_DTYPE=tl.bfloat16), num_warps=4)
out["sum"] = compile_(m._sum_topk_kernel, {
    "y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16", "H": "i32", "TOP_K": "i32",
    "expert_start": "i32", "num_local": "i32", "s_y": "i32", "s_o": "i32"},
    dict(BLOCK_H=1024), num_warps=4)
print(json.dumps(out))
'''


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90_without_spills():
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's wheel carries no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    spills = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(spills) == 13
    assert {k: v for k, v in spills.items() if v} == {}, spills
