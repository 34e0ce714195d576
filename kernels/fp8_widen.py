"""e4m3 -> fp16 in registers, for a product's operand whose reduction runs across rows.

In a decode kernel's p @ V the reduction runs over keys, which are V's rows: a B operand that
the tensor cores want paired along the strided dim. For a 16-bit V, Triton reads such a tile
from shared memory with ldmatrix.trans. For an 8-bit V that instruction does not exist on
sm_90, and ``v.to(tl.float16)`` lets Triton hoist the cast past the shared-memory read into
the operand's layout, so it reads the float8 tile a byte at a time: compiled offline for
sm_90 (Triton 3.7), the GQA decode kernel over a float8 cache at its tiles (64 keys, 2 warps)
does 128 ``ld.shared.b8`` and packs them with shifts and ors, per thread per tile — 954 PTX
instructions in its loop, against 562 plus 32 of these conversions without it.

``widen_e4m3_fp16`` is the same cast (cvt.rn.f16x2.e4m3x2, as Triton lowers ``.to`` on
Hopper: equal bits) as inline assembly marked impure, which Triton does not move across the
read. The tile is then widened in the layout it was read in (16-byte reads), stored to
shared memory as fp16 and read back transposed by ldmatrix, as a 16-bit V is. GPU only: the
interpreter runs no assembly (the CPU path does its products in float32 anyway).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen_e4m3_fp16(x):
    """float8_e4m3fn -> float16, elementwise, four values a 32-bit register."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
