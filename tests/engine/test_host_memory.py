"""The CPU KV pool's allocator: zeros like torch.zeros, on huge pages where THP allows."""

from __future__ import annotations

import gc
import re

import torch

from engine import host_memory


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)  # type: ignore[union-attr]
    except OSError:
        return "never"


def _huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        text = f.read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= addr < hi:
            return int(re.search(r"AnonHugePages:\s+(\d+)", block).group(1))  # type: ignore[union-attr]
    raise AssertionError(f"{addr:#x} is in no mapping")


def test_zeros_match_torch_zeros_and_are_writable() -> None:
    t = host_memory.zeros((32, 2, 4096), torch.bfloat16)  # 512 KiB: below a huge page
    assert t.shape == (32, 2, 4096) and t.dtype == torch.bfloat16 and bool((t == 0).all())
    big = host_memory.zeros((8, 4, 1 << 17), torch.float32)  # 16 MiB
    assert big.shape == (8, 4, 1 << 17) and big.is_contiguous() and bool((big == 0).all())
    big[3, 1, 7] = 2.5
    assert big.view(-1)[(3 * 4 + 1) * (1 << 17) + 7].item() == 2.5


def test_big_pools_are_aligned_and_on_huge_pages_where_thp_allows() -> None:
    t = host_memory.zeros((32, 1 << 20), torch.uint8)  # 32 MiB
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    huge = _huge_kib(t.data_ptr())
    if _thp_mode() in ("always", "madvise"):
        assert huge >= 16 * 1024, huge  # most of it; the kernel may leave a few small
    else:
        assert huge == 0, huge


def test_a_view_keeps_the_mapping_alive() -> None:
    t = host_memory.zeros((16, 1 << 20), torch.uint8)
    v = t[5]
    v.fill_(9)
    del t
    gc.collect()
    host_memory.zeros((16, 1 << 20), torch.uint8).fill_(1)  # would reuse freed memory
    assert bool((v == 9).all())


def test_moving_the_pool_into_shared_memory_keeps_views_and_values() -> None:
    # the ipc backend shares a producer's pool in place (KVPool.share_memory)
    t = host_memory.zeros((8, 1 << 20), torch.float16)
    t[2, 10] = 3.0
    row = t[2]
    t.untyped_storage().share_memory_()
    assert t.is_shared() and row[10].item() == 3.0
    row[11] = 4.0
    assert t[2, 11].item() == 4.0
