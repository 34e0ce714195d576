"""Host memory for the KV pool on CPU: transparent huge pages, asked for explicitly.

Where THP is in "madvise" mode (a common default), torch's CPU allocator gets 4 KiB pages.
A transfer that copies between processes (UCX's cma: process_vm_readv) pins every page
of the run, so 4 KiB pages cost about a third of its bandwidth here: bare ucxx moved 64 MiB
messages at 5.6 GB/s from torch-allocated memory and 8.8 GB/s from this allocator's
(``bench/probes/ucx_raw_probe.py --late --alloc``; bench/RESULTS.md). So the pool is an
anonymous private mapping, aligned to 2 MiB and advised as huge; it is zero-filled and
touched up front, as ``torch.zeros`` would be, so no page fault lands inside a forward or a
transfer.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on CPU, backed by huge pages where the OS has them."""
    nbytes = math.prod(shape) * dtype.itemsize
    madv = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or madv is None or sys.platform != "linux":
        return torch.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(m)
    offset = -ctypes.addressof(probe) % HUGE_PAGE  # a multiple of the page size
    del probe  # an exported buffer would pin the mapping beyond the tensor's life
    try:
        m.madvise(madv, offset, nbytes)
    except OSError:  # a kernel without THP: plain pages, still correct
        pass
    # frombuffer holds the mapping for as long as the tensor (or a view of it) lives
    t = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)
    t.zero_()  # fault every page in now (huge ones where granted)
    return t.view(dtype).view(shape)
