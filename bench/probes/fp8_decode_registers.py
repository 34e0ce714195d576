"""CPU: registers a thread, bytes spilled and shared memory of the float8 GQA decode kernel
(kernels/triton_decode_attention._decode_kernel; bf16 queries, fp16 products, Llama-3-8B's
4-head groups of 128, split with the fused merge) compiled for sm_90 as a launch specializes
it, at several tiles and merge widths, and how many programs an SM holds by registers.

MERGE_S is what the launcher passes: min(MERGE_CHUNK, next power of two of the split
count), so 4 at the 3 splits of bench/fp8_kv_bench.py's 32-128 x 4,096 points, 16 at 16 or
more splits. The residency by registers is what kernels.waves sizes the split count by
(triton_decode_attention.FP8_RESIDENT_PER_SM).

    python bench/probes/fp8_decode_registers.py
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from sm90_spills import PRELUDE  # noqa: E402

# (BLOCK_N, warps, stages, MERGE_S): the launcher's float8 tiles at 3 and 16 splits, then
# shorter tiles and more warps
POINTS = ((64, 2, 2, 4), (64, 2, 2, 16), (32, 2, 2, 4), (16, 2, 4, 4), (64, 4, 2, 4))
BODY = r'''
import re
import kernels.triton_decode_attention as dec
SIG = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "bt_ptr": "*i32", "lens_ptr": "*i32",
       "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32",
       "s_qb": "i32", "s_qh": "i32", "s_cb": "i64", "s_ckv": "i32", "s_cs": "i32",
       "s_ch": "i32", "s_btb": "i32", "s_ob": "i32", "s_oh": "i32", "qk_scale": "fp32",
       "v_scale": "fp32", "split_len": "i32", "num_splits": "i32"}
DIV = [k for k, v in SIG.items() if v.startswith("*") or (k.startswith("s_") and k != "s_btb")]
for bn, warps, stages, merge_s in POINTS:
    const = dict(G=4, BLOCK_G=16, D=128, BS=16, BLOCK_N=bn, SPLIT=True, COMPUTE=tl.float16,
                 IEEE=False, DYN=True, FUSED=True, G_PAD=4, MERGE_S=merge_s, ROUND=bn,
                 CLAMP_Q=True, PDL=True)
    k = compiled(dec._decode_kernel, SIG, const, DIV, num_warps=warps, num_stages=stages)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                       capture_output=True, text=True, check=True)
    os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
    per_program = (regs + 7) // 8 * 8 * 32 * warps  # allocated in 8-register steps a thread
    print(f"BLOCK_N {bn:3d}, {warps} warps, {stages} stages, MERGE_S {merge_s:2d}: "
          f"{regs} registers, {spilled} bytes spilled, {k.metadata.shared} B shared, "
          f"{65536 // per_program} programs an SM by registers")
'''


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, "-c", PRELUDE + f"POINTS = {POINTS!r}\n" + BODY],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    print(r.stdout, end="")


if __name__ == "__main__":
    main()
