"""Split-K for prefill attention: how many key splits a step gets, and the merge of their
partial results.

A prefill program owns (query head, ``BLOCK_M`` queries of one request) and walks every key
its queries see. A short chunk after a long cached prefix is one query tile per head, so
an 8B model's 128-token chunk after 2,048 cached tokens is 32 programs on a 132-SM H200,
each walking 2,176 keys while 100 SMs idle. Splitting each tile's key range over ``S``
programs (kernels/triton_prefill_attention.py, ``SPLIT``) spreads it over the GPU; each
split leaves a float32 partial output and its log2-domain log-sum-exp per (token, head),
and ``merge_splits`` combines them, as flash-decoding does for decode.

A split count is chosen only when it helps: the step's (query tile x head) programs must
leave SMs idle, and each split must keep at least MIN_SPLIT_KEYS keys (below that its
fixed cost, one query tile loaded and a [BLOCK_M, D] float32 partial written and read
back, outweighs the keys it saves). Long chunks have enough tiles and are never split.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The least keys a split walks (see the module docstring).
MIN_SPLIT_KEYS = 256
# At most this many splits: the partials are S x T x Hq x D float32 values.
MAX_SPLITS = 16
# Prefill programs resident per SM at the short-chunk tiles: BLOCK_M 128 at 8 warps uses
# 255 registers a thread (ptxas for sm_90, split variant, 80 bytes spilled), so one
# program fills an SM's 64K registers. Split until the grid is one full wave.
PROGRAMS_PER_SM = 1
MERGE_BLOCK_T = 16  # tokens per merge program


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so CPU tests still see the heuristic split
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_query_tiles(num_tokens: int, num_reqs: int, block_m: int) -> int:
    """An upper bound on a step's query tiles: sum over requests of ceil(n_b / block_m) is
    at most ceil(T / block_m) + B - 1, exact for one request."""
    if num_tokens == 0:
        return 0
    return triton.cdiv(num_tokens, block_m) + num_reqs - 1


def choose_prefill_splits(num_tiles: int, num_heads: int, max_seq_len: int,
                          device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per query tile: enough to fill the SMs the (tile x head) programs leave idle,
    none under MIN_SPLIT_KEYS keys; 1 (no split) when the grid already fills the GPU."""
    programs = max(1, num_tiles * num_heads)
    want = programs_per_sm * num_sms(device) // programs
    return max(1, min(want, max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS))


# the step's token count varies from step to step: unspecialized, one compile per D and
# tile (see _prefill_kernel's note in kernels/triton_prefill_attention.py)
@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    num_tokens, num_splits,
    s_ot, s_oh,  # out strides [T, Hq, D]; D is contiguous
    D: tl.constexpr, BLOCK_T: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,  # a split with lse -inf may have left no partial output
):
    """out[t, h] = the splits' partial outputs weighted by exp2(lse) (an online log-sum-exp
    over the splits). A split that saw no key of a row has lse -inf and weighs 0."""
    tb = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    d = tl.arange(0, D)
    tmask = t < num_tokens
    mx = tl.full([BLOCK_T], float("-inf"), tl.float32)
    wsum = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for s in range(num_splits):
        row = (s * num_tokens + t).to(tl.int64) * hq + h  # [BLOCK_T] rows of [S, T, Hq]
        lse = tl.load(part_lse_ptr + row, mask=tmask, other=float("-inf"))
        omask = tmask & (lse > float("-inf")) if SKIP_EMPTY else tmask
        o = tl.load(part_o_ptr + row[:, None] * D + d[None, :], mask=omask[:, None], other=0.0)
        mx_new = tl.maximum(mx, lse)
        safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)  # rows no split has seen yet
        scale = tl.exp2(mx - safe)
        w = tl.exp2(lse - safe)
        wsum = wsum * scale + w
        acc = acc * scale[:, None] + o * w[:, None]
        mx = mx_new
    res = acc / tl.where(wsum > 0.0, wsum, 1.0)[:, None]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * s_ot + h * s_oh + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=tmask[:, None])


def partials(num_splits: int, num_tokens: int, num_heads: int, head_dim: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, T, Hq, D] partial outputs and [S, T, Hq] log2-domain lse, float32, from one
    allocation (each costs host time on the launch path)."""
    n = num_splits * num_tokens * num_heads
    buf = torch.empty(n * (head_dim + 1), dtype=torch.float32, device=device)
    return buf[: n * head_dim], buf[n * head_dim:]


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 num_splits: int, skip_empty: bool = False) -> None:
    """Writes out [T, Hq, D] from the splits' partials (see ``partials``). skip_empty: the
    partial outputs of (split, row) pairs whose lse is -inf were never written (a fixed-grid
    launch's idle splits and padding rows), so they are not read."""
    num_tokens, hq, d = out.shape
    grid = (triton.cdiv(num_tokens, MERGE_BLOCK_T), hq)
    _merge_kernel[grid](part_o, part_lse, out, num_tokens, num_splits, out.stride(0),
                        out.stride(1), D=d, BLOCK_T=MERGE_BLOCK_T, SKIP_EMPTY=skip_empty,
                        num_warps=4)
