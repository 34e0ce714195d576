"""moe_align_multi (the align step's three-launch counting sort) against the torch
moe_align, bit for bit (interpreter on CPU, GPU with -m gpu)."""

from __future__ import annotations

import pytest
import torch


def _check(ids: torch.Tensor, bm: int, start: int, e_local: int) -> None:
    from kernels.triton_moe_align import moe_align, moe_align_multi

    want = moe_align(ids, bm, start, e_local)
    got = moe_align_multi(ids, bm, start, e_local)
    assert got[0].dtype == got[1].dtype == torch.int32
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()
    _check_runs(ids, bm, start, e_local, want[0], want[1])


def _check_runs(ids: torch.Tensor, bm: int, start: int, e_local: int,
                sorted_ids: torch.Tensor, block_expert: torch.Tensor) -> None:
    """With runs=, the same layout, plus each expert's run end (what the grouped-GEMM
    form's expert_offsets derives from the tiles) and each local pair's row; another
    rank's pairs' entries are left as they were."""
    from kernels.moe_grouped_gemm import expert_offsets
    from kernels.triton_moe_align import moe_align_multi

    n = ids.numel()
    ends = torch.full((e_local,), -7, dtype=torch.int32, device=ids.device)
    rows = torch.full((n,), -7, dtype=torch.int32, device=ids.device)
    got = moe_align_multi(ids, bm, start, e_local, runs=(ends, rows))
    assert got[0].tolist() == sorted_ids.tolist() and got[1].tolist() == block_expert.tolist()
    assert ends.tolist() == expert_offsets(block_expert, e_local, bm).tolist()
    local = ((ids.reshape(-1) - start >= 0) & (ids.reshape(-1) - start < e_local)).cpu()
    rows, sorted_ids = rows.cpu(), sorted_ids.cpu()
    assert sorted_ids[rows[local].long()].tolist() == torch.arange(n)[local].tolist()
    assert (rows[~local] == -7).all()


def _random_ids(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]  # distinct per token


# (t, k, global experts, expert_start, local experts, BLOCK_M): pairs from 1 to 5,000,
# local widths one under, at and over a power of two, and shards with another rank's
# experts on either side of this one's
@pytest.mark.parametrize("t,k,e,start,e_local,bm", [
    (1, 1, 1, 0, 1, 16),
    (37, 3, 10, 2, 7, 16),
    (300, 6, 64, 0, 64, 64),
    (625, 8, 160, 30, 65, 128),
    (250, 8, 258, 0, 130, 16),
    (512, 9, 258, 0, 258, 64),  # DeepSeek-V3: 256 experts + 2 shared, top 9
])
def test_multi_equals_torch_align(t, k, e, start, e_local, bm, device):
    _check(_random_ids(t, k, e, t).to(device), bm, start, e_local)


def test_multi_all_pairs_to_one_expert(device):
    # one run across every chunk: each chunk's base within it comes from the scan
    ids = torch.full((700, 2), 5, device=device)
    _check(ids, 128, 0, 7)
    _check(ids, 64, 3, 7)  # the expert is local 2 here
    _check(ids, 16, 6, 7)  # and another rank's here: no pair placed, every tile -1


def test_multi_empty_experts_and_runs_across_chunks(device):
    from kernels.triton_moe_align import multi_chunk

    chunk = multi_chunk(64)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (3 * chunk + 5,), generator=gen) * 4  # experts 1-3 mod 4 empty
    ids[chunk - 20:chunk + 30] = 12  # one run across a chunk boundary
    ids[2 * chunk - 1:2 * chunk + 1] = 63  # a run of two, one pair each side of the next
    _check(ids.reshape(-1, 1).to(device), 16, 0, 64)
    _check(ids.reshape(-1, 1).to(torch.int32).to(device), 64, 0, 64)  # int32 ids


def test_multi_equals_single_program(device):
    from kernels.triton_moe_align import moe_align_multi, moe_align_triton

    ids = _random_ids(100, 4, 20, 3).to(device)
    for bm in (16, 64):
        got = moe_align_multi(ids, bm, 4, 12)
        want = moe_align_triton(ids, bm, 4, 12)
        assert got[0].tolist() == want[0].tolist()
        assert got[1].tolist() == want[1].tolist()


def test_multi_no_pairs(device):
    from kernels.triton_moe_align import moe_align_multi

    sorted_ids, block_expert = moe_align_multi(
        torch.empty(0, 8, dtype=torch.int64, device=device), 16, 0, 8)
    assert sorted_ids.numel() == block_expert.numel() == 0
    ends = torch.full((8,), -7, dtype=torch.int32, device=device)
    moe_align_multi(torch.empty(0, 8, dtype=torch.int64, device=device), 16, 0, 8,
                    runs=(ends, torch.empty(0, dtype=torch.int32, device=device)))
    assert ends.tolist() == [0] * 8  # every run empty


def test_multi_loops_past_one_step(monkeypatch, device):
    # small steps, so that every loop of the three kernels takes several on a small call:
    # the scan over chunk blocks and expert blocks (one partial), the fill's and the tiles'
    # grid-stride loops
    import kernels.triton_moe_align as al

    for name, value in (("MULTI_CHUNK_MAX", 16), ("SCAN_C", 4), ("SCAN_E", 8),
                        ("FILL_ROWS", 16), ("PLACE_T", 2)):
        monkeypatch.setattr(al, name, value)
    ids = _random_ids(150, 3, 30, 5).to(device)
    for bm in (16, 64):
        _check(ids, bm, 3, 20)
