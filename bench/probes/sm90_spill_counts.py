"""CPU: register spills of the sm_90 kernel tests' kernels compiled as a launch specializes
them (tests/sm90_spills.py's default: 16-divisible pointers and strides) and compiled
without that specialization (how the harness compiled them before session 32), per kernel;
and the async copies and shared memory of the MoE gate/up kernel at the H200's prefill tile
both ways (unspecialized, its loads were not pipelined); and the block-scaled FP8 gate/up
kernel at tiles wider than the launcher's narrowing (BLOCK_SCALED_GATE_UP_TILE) allows.

    python bench/probes/sm90_spill_counts.py
"""

from __future__ import annotations

import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")]

from sm90_spills import spill_bytes  # noqa: E402

TESTS = ("test_moe_sm90", "test_mla_sm90", "test_kv_fp8_sm90", "test_fp8_split_gemm_sm90",
         "test_moe_align_sm90")
# forces the old compile: no argument specialized, whatever the body asks
UNSPECIALIZED = r'''
_spills = spills
def spills(fn, sig, const, divisible=None, **opts):
    return _spills(fn, sig, const, divisible=() if UNSPEC else divisible, **opts)
'''
PIPELINE = r'''
import kernels.triton_moe as m
GU = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ptr": "*i32",
      "bexp_ptr": "*i32", "sc_ptr": "*fp32", "ids_ptr": "*i64", "N": "i32", "H": "i32",
      "INTER": "i32", "TOP_K": "i32", "expert_start": "i32", "num_local": "i32",
      "s_x": "i32", "s_we": "i32", "s_wn": "i32", "s_o": "i32", "s_se": "i32", "s_sn": "i32"}
DIV = ("x_ptr", "w_ptr", "out_ptr", "sorted_ptr", "bexp_ptr", "sc_ptr", "ids_ptr", "H",
       "INTER", "s_x", "s_we", "s_wn", "s_o")
const = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, DOT_DTYPE=tl.bfloat16, IEEE=False,
             EVEN_K=True, PDL=True, PER_PAIR=False, SCALED=False, GROUP_K=1, ONE_GROUP=True)
sig = dict(GU, **{k: "constexpr" for k in const})
attrs = {} if UNSPEC else {(m._gate_up_kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                           for n in DIV}
k = triton.compile(ASTSource(fn=m._gate_up_kernel, signature=sig, constexprs=const,
                             attrs=attrs), target=TARGET, options=dict(num_warps=8, num_stages=3))
print("PIPELINE", k.asm["ttgir"].count("async_copy_global_to_local"), k.metadata.shared)
'''


# after the MoE test body's signatures (GU, DIV_GU: the text before its "# weights:")
BLOCK_SCALED = r'''
for bm, bn in ((64, 64), (64, 128), (128, 128)):
    out[f"{bm}x{bn}"] = spills(m._gate_up_kernel, dict(GU, w_ptr="*fp8e4nv"), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, DOT_DTYPE=tl.bfloat16, IEEE=False, EVEN_K=True,
        PDL=True, PER_PAIR=False, SCALED=True, GROUP_K=128, ONE_GROUP=False),
        divisible=DIV_GU, num_warps=8, num_stages=3)
'''


def main() -> None:
    for name in TESTS:
        body = importlib.import_module(name).BODY
        counts = {flag: spill_bytes(f"UNSPEC = {flag}\n" + UNSPECIALIZED + body)
                  for flag in (False, True)}
        print(f"== {name}: kernel, bytes spilled as launched / unspecialized")
        for kernel in sorted(counts[False]):
            launched, plain = counts[False][kernel], counts[True][kernel]
            if launched or plain:
                print(f"  {kernel}: {launched} / {plain}")
    moe_head = importlib.import_module("test_moe_sm90").BODY.split("# weights:")[0]
    wide = spill_bytes(moe_head + BLOCK_SCALED)
    print("block-scaled FP8 gate/up, bytes spilled as launched:", wide)
    import subprocess

    from sm90_spills import PRELUDE
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    for flag in (False, True):
        r = subprocess.run([sys.executable, "-c", PRELUDE + f"UNSPEC = {flag}\n" + PIPELINE],
                           capture_output=True, text=True, env=env, timeout=600, check=True)
        copies, shared = r.stdout.split("PIPELINE")[-1].split()
        print(f"MoE gate/up at 128 x 128 x 64, 3 stages asked, "
              f"{'unspecialized' if flag else 'as launched'}: {copies} async copies, "
              f"{shared} bytes of shared memory")


if __name__ == "__main__":
    main()
