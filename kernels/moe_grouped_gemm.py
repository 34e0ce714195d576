"""Prefill-sized calls of the fused MoE kernel (kernels/triton_moe.py) through torch's
grouped GEMM (`torch._grouped_mm`, CUTLASS on sm_90): steps 1-3 of its four on contiguous,
expert-sorted rows.

Why: at a 4,096-token prefill the routed experts are over half of a DeepSeek-V2-Lite step,
and the Triton grouped GEMMs (decode-shaped, or the tensor-memory form) run them at ~37% of
the matmul rate on an H100 (bench/RESULTS.md). The grouped GEMM takes one row offset per
expert instead of per-tile expert ids, so the rows must be contiguous per expert:
1. align (kernels/triton_moe_align.py) with ALIGN_ROWS-row tiles, then the sorted rows'
   tokens gathered into `xs` [P, H] (kernels/triton_moe_tma.gather_sorted_rows); each
   expert's run ends at `offs[e]`, its padding rows zero;
2. gate/up: one grouped GEMM of xs against w13 [E, 2I, H] (as [E, H, 2I], a transposed
   view), rounded to x's dtype as HF's unfused linears are, then SiLU x mul
   (kernels/triton_act.py);
3. down: one grouped GEMM of the activation against w2, rows of xs's order;
and `row_of_pair`, each pair's row in that order, for fused_moe's sum step, which reads
the rows through it (no scatter of the [T * k, H] rows back into pair order). Past
kernels.triton_moe_align.ALIGN_ONE_PROGRAM_MAX_PAIRS (128) pairs, so at MIN_TOKENS for any
routing, and with RUNS_FROM_ALIGN, the align's place kernel writes `offs` and `row_of_pair`
as it places the pairs; otherwise they are computed from the align's output (expert_offsets, the
row-map kernel).
Rows past the last run are neither written by the GEMMs nor read: the activation of them
is garbage nobody reads.

Taken for bf16 experts on sm_90 and sm_100 (the archs torch builds it for) from MIN_TOKENS
tokens; FP8 experts and decode-sized calls (which a CUDA graph captures) keep the Triton
kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_act import silu_and_mul
from kernels.triton_common import check
from kernels.triton_moe_align import moe_align_multi, moe_align_triton, one_program
from kernels.triton_moe_tma import GATHER_ROWS, gather_sorted_rows

# Calls with at least this many tokens take this form; None: none does. On an H100
# (bench/RESULTS.md, session 33), 4,096-token prefills with it from 1,024 tokens: V2-Lite's
# routed experts 1.46 -> 1.06 ms a layer, the whole prefill 63.2-64.0 -> 53.6-54.1 ms;
# Qwen3-30B-A3B's 93.0-93.2 -> 84.7 ms. Steps of 1,024-4,095 tokens were not timed.
MIN_TOKENS: int | None = 1024
# Each expert's run is padded to this many rows (the gather's program rows); the grouped
# GEMM itself takes any run length.
ALIGN_ROWS = GATHER_ROWS
MAP_ROWS = 1024  # sorted rows per program of the row-map kernel
# Past the one-program align's bound the align's place kernel can write the run ends and the
# row map itself (True); False computes them afterwards as the one-program align's calls do.
# On since an H100 timed it (session 36, bench/RESULTS.md: the 4k-token prefill 1.4% faster
# at V2-Lite's shape and 2.7% at Qwen3-30B-A3B's) and the -m gpu suite ran with it on
# (session 37); bench/moe_bench.py --prefill-variants "kernels.moe_grouped_gemm.
# RUNS_FROM_ALIGN=False" is the A/B.
RUNS_FROM_ALIGN = True


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, fp8: bool,
            num_tokens: int) -> bool:
    """Whether fused_moe takes this form for the call."""
    if MIN_TOKENS is None or num_tokens < MIN_TOKENS or fp8 or not available():
        return False
    if x.dtype != torch.bfloat16 or not x.is_cuda:  # torch's CUTLASS kernels are bf16 ...
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):  # ... for sm_90/sm_100
        return False
    # operand rows 16-byte aligned (H and I multiples of 8)
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * 2) % 16 == 0
               for t in (x, w13, w2))


@triton.jit
def _row_map_kernel(sorted_ptr, map_ptr, N, P, BLOCK: tl.constexpr):
    """map[pair] = r for every sorted row r that holds a pair (padding rows hold N)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pair = tl.load(sorted_ptr + rows, mask=rows < P, other=N)
    tl.store(map_ptr + pair, rows.to(tl.int32), mask=pair < N)


def expert_offsets(block_expert: torch.Tensor, num_local: int, block_m: int) -> torch.Tensor:
    """offs [E] int32: the end row of each local expert's padded run in the align layout
    (runs in expert order, tiles of one expert each, -1 past the last), from the tiles
    alone, on the device."""
    tiles = torch.zeros(num_local + 1, dtype=torch.int32, device=block_expert.device)
    tiles.index_add_(0, (block_expert + 1).long(),
                     torch.ones_like(block_expert, dtype=torch.int32))
    return (tiles[1:].cumsum(0) * block_m).to(torch.int32)


def expert_rows_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        ids: torch.Tensor, expert_start: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; ids [T, k] global expert ids.
    Returns (ys [P, H], row_of_pair [T * k] int32): ys[row_of_pair[t * k + j]] is expert
    ids[t, j]'s output for token t, rounded to x's dtype, for this rank's pairs (other
    ranks' pairs have no row; their map entries are unset)."""
    check(available(), "torch._grouped_mm: this torch has no grouped GEMM")
    e_local = w13.shape[0]
    k = ids.shape[1]
    n = x.shape[0] * k
    check(w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1,
          "x, w13, w2: expected contiguous rows (the grouped-GEMM form)")
    check(ids.is_contiguous(), "topk_ids: expected contiguous")
    row_of_pair = torch.empty(n, dtype=torch.int32, device=x.device)
    multi = not one_program(n)
    if multi and RUNS_FROM_ALIGN:
        # the place kernel writes the run ends and the row map as it places the pairs: ten
        # fewer launches a layer than the torch ops and the map kernel below
        offs = torch.empty(e_local, dtype=torch.int32, device=x.device)
        sorted_ids, block_expert = moe_align_multi(ids, ALIGN_ROWS, expert_start, e_local,
                                                   runs=(offs, row_of_pair))
    else:
        align = moe_align_multi if multi else moe_align_triton
        sorted_ids, block_expert = align(ids, ALIGN_ROWS, expert_start, e_local)
        offs = expert_offsets(block_expert, e_local, ALIGN_ROWS)
        _row_map_kernel[(triton.cdiv(sorted_ids.shape[0], MAP_ROWS),)](
            sorted_ids, row_of_pair, n, sorted_ids.shape[0], BLOCK=MAP_ROWS, num_warps=4)
    xs = gather_sorted_rows(x, sorted_ids, block_expert, k, ALIGN_ROWS)
    # rows past offs[-1] are neither read nor written by the GEMMs (nor mapped). Each
    # operand is dropped once read: the peak is xs and gate_up, [P, H + 2I], which
    # engine/memory_budget.py's activation estimate covers.
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [P, 2I]
    del xs
    act = silu_and_mul(gate_up)
    del gate_up
    ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [P, H]
    del act
    return ys, row_of_pair
