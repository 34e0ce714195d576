"""The MLA decode, merge and latent-store kernels compile for an H200 (sm_90) without a GPU,
at DeepSeek's latent (512 + 64, bf16) and the launcher's default tiles, with no register
spills: ptxas from Triton's wheel, in a child process (the kernel tests' conftest runs
Triton in its interpreter, which compiles nothing). The interpreter tests check values;
this catches what only the compiler sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import json, os, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.triton_mla_decode as m
import kernels.triton_store_kv as s

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)


def spills(fn, sig, const, **opts):
    sig = dict(sig, **{k: "constexpr" for k in const})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=TARGET,
                       options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True, check=True)
    os.unlink(f.name)
    line = [l for l in r.stderr.splitlines() if "spill stores" in l][0]
    return int(line.split("bytes spill stores")[0].split(",")[-1])


DEC = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i64",
       "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "s_qb": "i32",
       "s_qh": "i32", "s_cb": "i64", "s_cs": "i32", "s_btb": "i32", "s_ob": "i32",
       "s_oh": "i32", "qk_scale": "fp32", "split_len": "i32", "num_splits": "i32", "H": "i32"}
out = {}
for block_h in (16, 32):  # the launcher's choices: up to 16 heads, and more
    for split in (False, True):
        out[f"decode/h{block_h}/split{int(split)}"] = spills(m._mla_decode_kernel, DEC, dict(
            C=512, R=64, CP=512, RP=64, BLOCK_H=block_h, BS=64, BLOCK_N=m.BLOCK_N,
            SPLIT=split, COMPUTE=tl.bfloat16, IEEE=False, DYN=split),
            num_warps=m.NUM_WARPS, num_stages=m.NUM_STAGES)
out["merge"] = spills(m._mla_merge_kernel, {
    "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "lens_ptr": "*i64",
    "s_ob": "i32", "s_oh": "i32", "split_len": "i32", "num_splits": "i32"},
    dict(C=512, CP=512, MERGE_S=m.MERGE_CHUNK, BLOCK_N=m.BLOCK_N, DYN=True), num_warps=4)
out["store_latent"] = spills(s._store_latent_kernel, {
    "src_ptr": "*bf16", "kv_ptr": "*bf16", "slot_ptr": "*i64", "s_t": "i32", "s_cb": "i64",
    "s_cs": "i32"}, dict(D=576, BS=64, BLOCK_D=1024), num_warps=4)
print(json.dumps(out))
'''


@pytest.mark.slow
def test_mla_kernels_compile_for_sm90_without_spills():
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's wheel carries no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(found) == 6
    assert {k: v for k, v in found.items() if v} == {}, found
