"""Triton simple sampler: greedy or temperature-only seeded draws in one pass over the
logits, with the noise hashed in the kernel (see ref_sample.sample_simple_ref).

The torch path materialises [S, V] float32 noise through ~50 elementwise int64 kernels,
then a softmax, a division and an argmax; here each program reads its slice of the
logits once. The draw is the exponential race in the log domain, argmax(x / T - log E),
which picks the same token as argmax(softmax(x / T) / E) up to float rounding. The hash
runs in uint32: multiplying 32-bit values mod 2**32 keeps exactly the bits that the
reference's int64 product keeps after its 32-bit mask.

A structured-output bitmask (``allowed``) is applied as each tile is read, so a
constrained row costs one more small load per tile instead of passes over [S, V].

Graph-safe: no host reads of device values; the grid depends only on the shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check, check_device, check_float, check_int, check_shape

CHUNK = 8192  # vocabulary entries per program: [S, V / CHUNK] programs fill the GPU
BLOCK = 1024  # entries per inner-loop tile


@triton.jit
def _hash32(x):
    """kernels.random_draw._hash32 on uint32 (products wrap mod 2**32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _sample_partial_kernel(
    logits_ptr, temp_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, mask_ptr,
    s_l, s_m, V, num_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _hash32(_hash32(_hash32(lo) ^ hi) ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    base = logits_ptr + row.to(tl.int64) * s_l
    best = float("-inf")
    best_i = 0
    for c0 in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, V), BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if temp > 0:
            colh = _hash32(cols.to(tl.uint32) * 0x9E37)
            bits = _hash32(key ^ colh)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            x = x / temp - tl.log(-tl.log(u))
            x = tl.where(mask, x, float("-inf"))
        if HAS_MASK:  # structured output: bit c of the row's words allows token c
            # after the noise: a draw of u = 1 makes -log(-log(u)) infinite, and -inf + inf
            # would be NaN on a disallowed token
            w = tl.load(mask_ptr + row.to(tl.int64) * s_m + cols // 32, mask=mask, other=0)
            x = tl.where(((w >> (cols % 32)) & 1) != 0, x, float("-inf"))
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0)  # first index of the maximum
        if m > best:  # strict: an earlier tile wins a tie, as torch.argmax
            best = m
            best_i = c0 + i
    tl.store(best_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, best_i)


@triton.jit
def _sample_reduce_kernel(best_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    best = tl.load(best_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    j = tl.argmax(best, axis=0)  # the first chunk holding the maximum: the lowest index
    idx = tl.load(idx_ptr + row * num_chunks + j)
    tl.store(out_ptr + row, idx.to(tl.int64))


def sample_simple(
    logits: torch.Tensor,  # [S, V] float, rows contiguous
    temperature: torch.Tensor,  # [S] float32; <= 0: greedy
    seeds: torch.Tensor,  # [S] int64
    positions: torch.Tensor,  # [S] int32/int64
    out: torch.Tensor | None = None,  # [S] int64
    allowed: torch.Tensor | None = None,  # [S, ceil(V / 32)] int32 bitmask (None: all)
) -> torch.Tensor:
    check(logits.dim() == 2, "logits: expected [S, V]")
    s, v = logits.shape
    check(logits.stride(1) == 1, "logits: rows must be contiguous")
    check_float("logits", logits)
    check_shape("temperature", temperature, (s,))
    check(temperature.dtype == torch.float32, "temperature: expected float32")
    check_shape("seeds", seeds, (s,))
    check_shape("positions", positions, (s,))
    check_int("seeds", seeds)
    check_int("positions", positions)
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    check_shape("out", out, (s,))
    check(out.dtype == torch.int64, "out: expected int64")
    check_device(logits, temperature, seeds, positions, out)
    if allowed is not None:
        check_shape("allowed", allowed, (s, (v + 31) // 32))
        check(allowed.dtype == torch.int32 and allowed.stride(1) == 1,
              "allowed: expected int32 with contiguous rows")
        check_device(logits, allowed)
    if s == 0:
        return out
    chunks = triton.cdiv(v, CHUNK)
    best = torch.empty(s * chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(s * chunks, dtype=torch.int32, device=logits.device)
    _sample_partial_kernel[(s, chunks)](
        logits, temperature, seeds, positions, best, idx,
        allowed if allowed is not None else idx, logits.stride(0),
        allowed.stride(0) if allowed is not None else 0, v, chunks,
        CHUNK=CHUNK, BLOCK=BLOCK, HAS_MASK=allowed is not None, num_warps=4)
    _sample_reduce_kernel[(s,)](best, idx, out, chunks,
                                BLOCK_C=max(2, triton.next_power_of_2(chunks)), num_warps=1)
    return out
