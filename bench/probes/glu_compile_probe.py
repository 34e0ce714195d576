"""The FP8 GEMV (kernels/triton_fp8_weight_only._gemv_kernel) compiled for sm_90 without a
GPU, plain and with the fused activation (GLU), at the 8B gate_up launch's specialization
(one row, 32 x 256 tiles, 4 warps, 3 stages, pointers, strides and K divisible by 16):
registers, spills, shared memory and its loads, async copies and layout conversions of
each, so the two loops can be compared (bench/RESULTS.md, "The MLP's activation in the FP8
gate_up GEMV").

    python bench/probes/glu_compile_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.triton_fp8_weight_only as wo

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "s_xm": "i32", "s_wn": "i32", "s_sn": "i32", "s_os": "i32",
           "s_om": "i32", "k_per_split": "i32"}
    divisible = [k for k, v in sig.items() if v.startswith("*") or k.startswith("s_")
                 or k in ("N", "k_per_split")]
    attrs = {(wo._gemv_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    for glu in (False, True):
        const = dict(GROUP_K=4096, ONE_GROUP=True, EVEN_K=True, ROWS=1, EVICT_FIRST=True,
                     PDL=True, GLU=glu, BLOCK_N=32, BLOCK_K=256, STAGES=3)
        src = ASTSource(fn=wo._gemv_kernel, signature=dict(sig, **{k: "constexpr" for k in const}),
                        constexprs=const, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
        os.unlink(f.name)
        info = "; ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                         if "registers" in line or "spill" in line)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        print(f"GLU={glu}: {info}; shared {k.metadata.shared} B; "
              f"shared-memory loads {ptx.count('ld.shared')}; "
              f"async copies {ttgir.count('async_copy_global_to_local')}; "
              f"layout conversions {ttgir.count('convert_layout')}")


if __name__ == "__main__":
    main()
