"""Attention tile configs fit the device's shared memory for every dtype and head dim."""

from __future__ import annotations

import pytest
import torch

from kernels.tile_fit import Tiles, fit_attention_tiles, launch_fitting, shrink, smem_bytes

H200_SMEM = 232_448  # bytes per block an H200 allows (the figure Triton reported)
PREFILL_DEFAULT = Tiles(256, 64, 3, 8)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_estimate_covers_the_measured_overflow():
    # Triton asked for 263,424 B for the bf16-tuned prefill tiles at fp32, head dim 128.
    est = smem_bytes(PREFILL_DEFAULT, 128, 4)
    assert 263_424 <= est <= 263_424 + 8192


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fit_shrinks_only_what_does_not_fit(dtype, d):
    elem = torch.empty((), dtype=dtype).element_size()
    t = fit_attention_tiles(PREFILL_DEFAULT, d, dtype, torch.device("cpu"), limit=H200_SMEM)
    assert smem_bytes(t, d, elem) <= H200_SMEM
    if smem_bytes(PREFILL_DEFAULT, d, elem) <= H200_SMEM:
        assert t == PREFILL_DEFAULT  # bf16 keeps its tuned tiles
    else:
        assert t != PREFILL_DEFAULT
        assert t.block_m * t.block_n <= PREFILL_DEFAULT.block_m * PREFILL_DEFAULT.block_n


def test_fp32_d128_prefill_gets_fewer_stages_first():
    t = fit_attention_tiles(PREFILL_DEFAULT, 128, torch.float32, torch.device("cpu"),
                            limit=H200_SMEM)
    assert t == Tiles(256, 64, 2, 8)


def test_shrink_ladder_ends_and_respects_the_row_floor():
    t: Tiles | None = PREFILL_DEFAULT
    seen = []
    while t is not None:
        seen.append(t)
        t = shrink(t, min_block_m=16)
    assert seen[-1] == Tiles(16, 16, 2, 8)
    assert len(set(seen)) == len(seen)
    assert shrink(Tiles(16, 16, 2, 4), min_block_m=16) is None
    # decode pads its query group to block_m: never shrunk below it
    assert all(x.block_m == 32 for x in _ladder(Tiles(32, 64, 4, 4), 32))


def _ladder(t: Tiles, floor: int) -> list[Tiles]:
    out = []
    cur: Tiles | None = t
    while cur is not None:
        out.append(cur)
        cur = shrink(cur, floor)
    return out


def test_launch_fitting_retries_on_out_of_resources_and_remembers():
    from triton.runtime.errors import OutOfResources

    tried: list[Tiles] = []

    def launch(t: Tiles) -> None:
        tried.append(t)
        if smem_bytes(t, 128, 4) > 150_000:
            raise OutOfResources(smem_bytes(t, 128, 4), 150_000, "shared memory")

    got = launch_fitting(("unit", 1), PREFILL_DEFAULT, launch)
    assert smem_bytes(got, 128, 4) <= 150_000
    assert tried[0] == PREFILL_DEFAULT and tried[-1] == got and len(tried) > 1
    tried.clear()
    assert launch_fitting(("unit", 1), PREFILL_DEFAULT, launch) == got
    assert tried == [got]  # the second call starts from what worked


def test_launch_fitting_gives_up_with_the_compilers_error():
    from triton.runtime.errors import OutOfResources

    def launch(t: Tiles) -> None:
        raise OutOfResources(1 << 20, 1, "shared memory")

    with pytest.raises(OutOfResources):
        launch_fitting(("unit", 2), Tiles(32, 32, 3, 4), launch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_tiles_run_on_gpu(dtype, d, gen, close):
    """Both launchers with their default tiles, every dtype and head dim, against the refs."""
    from kernels.ref_attention import decode_attention_ref, prefill_attention_ref
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_prefill_attention import prefill_attention

    dev = torch.device("cuda")
    reqs = [(0, 700), (300, 129), (1000, 1)]
    lens = [c + n for c, n in reqs]
    nb = sum(-(-n // 16) for n in lens)
    kv = torch.randn(nb, 2, 16, 2, d, generator=gen).to(dtype=dtype, device=dev)
    # every row a shuffle of all blocks: requests share them, attention only reads
    table = torch.stack([torch.randperm(nb, generator=gen) for _ in lens])
    table = table.to(device=dev, dtype=torch.int32)
    chunk = [n for _, n in reqs]
    cu = torch.tensor([0] + chunk).cumsum(0).to(torch.int32).to(dev)
    q = torch.randn(sum(chunk), 8, d, generator=gen).to(dtype=dtype, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = d ** -0.5
    close(prefill_attention(q, kv, table, cu, seq_lens, scale),
          prefill_attention_ref(q, kv, table, cu, seq_lens, scale), dtype)
    qd = torch.randn(len(lens), 8, d, generator=gen).to(dtype=dtype, device=dev)
    close(decode_attention(qd, kv, table, seq_lens, scale),
          decode_attention_ref(qd, kv, table, seq_lens, scale), dtype)
