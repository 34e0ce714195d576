from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, NoFreeBlocks


def test_allocate_free_refcount_accounting():
    bm = BlockManager(8, block_size=4)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.accounting().used == 3
    bm.share(a[:1])
    bm.free(a)
    acc = bm.accounting()
    assert (acc.free, acc.used, acc.total) == (7, 1, 8)  # the shared block still has an owner
    bm.free(a[:1])
    assert bm.accounting().free == 8
    with pytest.raises(NoFreeBlocks):
        bm.allocate(9)
    with pytest.raises(AssertionError):
        bm.free([0])


def test_grow_is_all_or_nothing():
    bm = BlockManager(4, block_size=4)
    ids: list[int] = []
    assert bm.grow(ids, 9) and len(ids) == 3
    assert bm.grow(ids, 12) and len(ids) == 3
    assert not bm.grow(ids, 21) and len(ids) == 3 and bm.num_free == 1
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(4) == 1


def test_bad_size():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockManager(0, 4)
