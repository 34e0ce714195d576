"""Which request a prefill program's query tile belongs to, with no host sync.

Both prefill attention kernels (kernels/triton_prefill_attention.py for paged GQA,
kernels/triton_mla_prefill.py for MLA's decompressed context) size their grid from shapes
alone: request ``b``'s query tiles of ``BLOCK_M`` rows take the slots
``cu[b] // BLOCK_M + b ...``, which never overlap and fit in ``T // BLOCK_M + B`` slots
(kernels/triton_prefill_split.max_query_tiles). A program finds its request by binary
search over ``cu_seqlens_q``; a request's spare slot (at most one each) gets a tile index
past its rows and exits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def request_of_slot(cu_ptr, slot, num_reqs, search_steps, BLOCK_M: tl.constexpr):
    """(b, q_start, n_q, mt): the request owning ``slot`` (the largest b with
    ``cu[b] // BLOCK_M + b <= slot``), its first query row and query count, and the slot's
    query tile within its chunk (``mt * BLOCK_M >= n_q``: a spare slot).
    ``search_steps``: ceil(log2(num_reqs + 1))."""
    lo = 0
    hi = num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        owns = tl.load(cu_ptr + mid) // BLOCK_M + mid <= slot
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    b = lo
    q_start = tl.load(cu_ptr + b)
    n_q = tl.load(cu_ptr + b + 1) - q_start
    mt = slot - (q_start // BLOCK_M + b)
    return b, q_start, n_q, mt
