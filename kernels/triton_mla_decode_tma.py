"""Paged MLA decode with each KV page loaded by the tensor-memory engine (TMA): the same
contract and split scheme as kernels/triton_mla_decode.py, whose pointer form it replaces
where ``triton_mla_decode.FORM`` is "tma" and the shapes allow (``tma_fits``).

Why a second form: on an H200 the pointer form streams the latent cache at 58% (batch 32 x
4,096) and 69% (batch 128) of the HBM read rate where an H100 reaches 71% and 87% with the
same grids (bench/RESULTS.md, "The V2-Lite table on an H200 after the wave-filling MLA
splits"), so each program's streaming rate, not the grid, bounds it on the faster memory.
A pointer tile of [32, 576] is ~18k addresses a program computes and issues per step; a
page here is one copy-engine request per 256 columns, landing in shared memory behind an
mbarrier, so more of a program's bytes can be in flight (``NUM_STAGES`` pages) at the
register cost of none.

The cache is viewed as [NB, BS, C + R] (block stride, token stride, 1): a tile of one
layer's page is one [1, BLOCK_N, width] box at (block, row, column), BLOCK_N the page or
TILE_ROWS of it (``tile_rows``). Tiles never cross pages, split lengths are whole tiles, and
only a request's last tile is partial: the full tiles run unmasked and the last one, if
partial, zeroes its rows past the context (the page's tail is whatever was there; 0 x NaN
would poison the product). C is taken in one or two column boxes of at most 256 (the copy
engine's box limit), each with its own accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.pdl import follow
from kernels.triton_common import check
from kernels.triton_split_len import head_block_split

BOX_MAX = 256  # the copy engine's largest box dimension (elements)
# Tiles (module constants so a benchmark variant can set each one). Pipeline stages, warps
# per program, and how many programs an SM holds for the split count. Compiled for sm_90 at
# 16-row tiles, stages 3-4 keep two tile buffers in shared memory (37 KB) and 5-6 three
# (56 KB), the page's block number being a load of its own; at 223 registers a thread two
# 4-warp programs fit an SM either way. Five stages timed best on an H100 (two buffers:
# 7.8 ms against 6.1 at batch 128 x 4,096; bench/RESULTS.md).
NUM_STAGES = 5
NUM_WARPS = 4
# Tokens per tile: a page, or a slice of one past this many (the products' operands sit in
# registers at 16 query heads: a 64-row tile of both boxes spilled 0.5-1 KB, ptxas sm_90;
# 16 and 32 rows spill none).
TILE_ROWS = 32
PROGRAMS_PER_SM = 2
# Columns of C per box (the copy engine's limit): C takes one box or two, each with its own
# accumulator. (Four boxes of 128, and each box scored by its own product summed after
# instead of one chain of products, were timed on an H100: no faster; bench/RESULTS.md.)
MAX_BOXES = 2


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def c_box(c: int) -> int:
    """Columns of C per box: C itself up to BOX_MAX, else BOX_MAX (C a power of two)."""
    return min(c, BOX_MAX)


def tile_rows(bs: int) -> int:
    """Tokens per tile for pages of bs tokens: the page, or TILE_ROWS of it (a power of two
    of 16 or more, so that tiles divide pages and never cross one)."""
    if not (_pow2(TILE_ROWS) and 16 <= TILE_ROWS <= BOX_MAX):
        raise ValueError(f"TILE_ROWS: {TILE_ROWS} is not a power of two in [16, {BOX_MAX}]")
    return min(bs, TILE_ROWS)


def tma_fits(q: torch.Tensor, kv_layer: torch.Tensor, c: int) -> bool:
    """Whether this call can take the TMA form: a CUDA device of sm_90 or later (or the
    interpreter, for tests), a power-of-two page of 16 tokens or more, C a power of two in
    at most MAX_BOXES boxes, R a power of two of 16 or more (a product's least inner size;
    the interpreter does not enforce it, Triton's compiler does), and the 16-byte alignment
    the copy engine needs of the base and of the block and token strides."""
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    bs, width = kv_layer.shape[2], kv_layer.shape[4]
    r = width - c
    esz = kv_layer.element_size()
    cb = c_box(c)
    return (_pow2(bs) and bs >= 16
            and _pow2(c) and 16 <= cb <= BOX_MAX and c // cb <= MAX_BOXES
            and _pow2(r) and 16 <= r <= BOX_MAX and r * esz >= 16
            and kv_layer.data_ptr() % 16 == 0
            and (kv_layer.stride(0) * esz) % 16 == 0 and (kv_layer.stride(2) * esz) % 16 == 0)


@triton.jit
def _box(desc, blk, row, col, nmask, BLOCK_N: tl.constexpr, W: tl.constexpr,
         COMPUTE: tl.constexpr, MASKED: tl.constexpr):
    """One [BLOCK_N, W] box of a page; MASKED: rows past the context zeroed."""
    x = desc.load([blk, row, col]).reshape(BLOCK_N, W).to(COMPUTE)
    if MASKED:
        x = tl.where(nmask[:, None], x, 0.0)
    return x


@triton.jit
def _tile(c_desc, r_desc, bt_row, n0, end, qk_scale, q_c0, q_c1, q_r, m, lsum, acc0, acc1,
          C: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NBOX: tl.constexpr,
          BS: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
          PREC: tl.constexpr, MASKED: tl.constexpr):
    """One tile of BLOCK_N tokens from position n0: its scores against every head, folded
    into the online softmax (m, lsum) and the boxes' accumulators."""
    blk = tl.load(bt_row + n0 // BS)
    row = n0 % BS
    nmask = n0 + tl.arange(0, BLOCK_N) < end
    lat0 = _box(c_desc, blk, row, 0, nmask, BLOCK_N, CB, COMPUTE, MASKED)
    kpe = _box(r_desc, blk, row, C, nmask, BLOCK_N, R, COMPUTE, MASKED)
    s = tl.dot(q_c0, tl.trans(lat0), input_precision=PREC)  # [BLOCK_H, BLOCK_N]
    lat1 = lat0
    if NBOX > 1:
        lat1 = _box(c_desc, blk, row, CB, nmask, BLOCK_N, CB, COMPUTE, MASKED)
        s = tl.dot(q_c1, tl.trans(lat1), s, input_precision=PREC)
    s = tl.dot(q_r, tl.trans(kpe), s, input_precision=PREC) * qk_scale
    if MASKED:
        s = tl.where(nmask[None, :], s, float("-inf"))  # a valid token: n0 < end
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    pc = p.to(COMPUTE)
    acc0 = acc0 * alpha[:, None] + tl.dot(pc, lat0, input_precision=PREC)
    if NBOX > 1:
        acc1 = acc1 * alpha[:, None] + tl.dot(pc, lat1, input_precision=PREC)
    return m_new, lsum, acc0, acc1


@triton.jit
def _store_box(part_o_ptr, out_ptr, o_row, part, acc, inv, col: tl.constexpr, hmask,
               C: tl.constexpr, CB: tl.constexpr, SPLIT: tl.constexpr):
    """One box's columns of the output (or of the split's float32 partial)."""
    cc = tl.arange(0, CB)
    o = acc * inv[:, None]
    if SPLIT:
        tl.store(part_o_ptr + part[:, None] * C + col + cc[None, :], o, mask=hmask[:, None])
    else:
        tl.store(o_row + col + cc[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None])


@triton.jit
def _mla_decode_tma_kernel(
    q_ptr, c_desc, r_desc, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    s_qb, s_qh,  # q strides [B, H, C + R]; the last dim is contiguous
    s_btb,  # block_tables row stride
    s_ob, s_oh,  # out strides [B, H, C]
    qk_scale,  # softmax scale * log2(e) (* a float8 cache's scale): log2-domain scores
    v_scale,  # a float8 cache's scale (1.0 otherwise): multiplies the output
    split_len,  # tokens per split, whole tiles (DYN: the least per split)
    num_splits, H,
    C: tl.constexpr, R: tl.constexpr, CB: tl.constexpr, NBOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    COMPUTE: tl.constexpr, PREC: tl.constexpr, DYN: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # q is the kernel before's output; out may reuse its memory (kernels/pdl.py)
        follow()
    b, split, seq_len, start, end, h, hmask = head_block_split(
        lens_ptr, split_len, num_splits, H, BLOCK_H, BLOCK_N, DYN)  # h: [BLOCK_H] query heads
    if SPLIT:
        if start >= seq_len:  # the merge reads only the splits this request used
            return
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # whole tiles
    cc = tl.arange(0, CB)
    q_row = q_ptr + b.to(tl.int64) * s_qb + h[:, None] * s_qh + cc[None, :]
    q_c0 = tl.load(q_row, mask=hmask[:, None], other=0.0).to(COMPUTE)
    q_c1 = q_c0
    if NBOX > 1:
        q_c1 = tl.load(q_row + CB, mask=hmask[:, None], other=0.0).to(COMPUTE)
    r = tl.arange(0, R)
    q_r = tl.load(q_ptr + b.to(tl.int64) * s_qb + h[:, None] * s_qh + C + r[None, :],
                  mask=hmask[:, None], other=0.0).to(COMPUTE)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, CB], tl.float32)
    acc1 = tl.zeros([BLOCK_H, CB], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for n0 in range(start, full_end, BLOCK_N):
        m, lsum, acc0, acc1 = _tile(c_desc, r_desc, bt_row, n0, end, qk_scale, q_c0, q_c1, q_r,
                                    m, lsum, acc0, acc1, C, R, CB, NBOX, BS, BLOCK_N, COMPUTE,
                                    PREC, False)
    # the request's last, partial tile (or none), its rows past the context zeroed: a loop
    # of its own, not pipelined (as straight-line code after the loop it spilled 0.3 KB)
    for n0 in tl.range(full_end, end, BLOCK_N, num_stages=1):
        m, lsum, acc0, acc1 = _tile(c_desc, r_desc, bt_row, n0, end, qk_scale, q_c0, q_c1, q_r,
                                    m, lsum, acc0, acc1, C, R, CB, NBOX, BS, BLOCK_N, COMPUTE,
                                    PREC, True)

    inv = v_scale / tl.where(lsum > 0.0, lsum, 1.0)  # no context: zeros
    part = (b * H + h).to(tl.int64) * num_splits + split  # [BLOCK_H] (SPLIT)
    o_row = out_ptr + b * s_ob + h[:, None] * s_oh
    _store_box(part_o_ptr, out_ptr, o_row, part, acc0, inv, 0, hmask, C, CB, SPLIT)
    if NBOX > 1:
        _store_box(part_o_ptr, out_ptr, o_row, part, acc1, inv, CB, hmask, C, CB, SPLIT)
    if SPLIT:
        lse = tl.where(lsum > 0.0, m + tl.log2(tl.maximum(lsum, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=hmask)


def launch(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, part_o: torch.Tensor,
           part_lse: torch.Tensor, qk_scale: float, v_scale: float, split_len: int,
           num_splits: int, c: int, cp: int, block_h: int, block_n: int, split: bool,
           dyn: bool, compute: object, ieee: bool, pdl: bool, num_warps: int | None = None,
           num_stages: int | None = None) -> None:
    """Launches the kernel over (request, head block, split). The caller (mla_decode's
    unmerged step) checked ``tma_fits``, took block_n from ``tile_rows`` and sized the
    splits in whole tiles of it; the merges read the partials' rows at its width cp."""
    nb, _, bs, _, width = kv_layer.shape
    check(block_n == tile_rows(bs) and cp == c, f"block_n {block_n}, cp {cp}: the TMA "
          f"form's tile is tile_rows({bs}) and its partials' rows are C ({c}) wide")
    cb = c_box(c)
    shape = [nb, bs, width]
    strides = [kv_layer.stride(0), kv_layer.stride(2), 1]
    c_desc = TensorDescriptor(kv_layer, shape, strides, [1, block_n, cb])
    r_desc = TensorDescriptor(kv_layer, shape, strides, [1, block_n, width - c])
    bsz, heads, _ = q.shape
    _mla_decode_tma_kernel[(bsz, triton.cdiv(heads, block_h), num_splits)](
        q, c_desc, r_desc, block_tables, seq_lens, out, part_o, part_lse,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        qk_scale, v_scale, split_len, num_splits, heads,
        C=c, R=width - c, CB=cb, NBOX=c // cb, BLOCK_H=block_h, BS=bs, BLOCK_N=block_n,
        SPLIT=split,
        COMPUTE=compute, PREC="ieee" if ieee else None, DYN=dyn, PDL=pdl,
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages, launch_pdl=pdl,
    )
