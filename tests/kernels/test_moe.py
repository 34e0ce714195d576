"""Fused MoE kernel against its torch reference (interpreter on CPU, GPU with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_moe import fused_moe_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The kernel rounds to the storage dtype three times (gate/up outputs, the activation, each
# expert's output) as HF's unfused experts do; the interpreter's float32 -> bf16 cast
# truncates, so on CPU those roundings add a bias the conftest bound (one rounding) does
# not allow for. Measured 1.1-1.3% against the float32 reference on the shapes below.
INTERP_BF16_TOL = 2.5e-2


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, close) -> None:
    if dtype == torch.bfloat16 and not out.is_cuda:
        assert torch.isfinite(out).all()
        err = float((out.double() - ref.double()).norm() / ref.double().norm())
        assert err < INTERP_BF16_TOL, err
        return
    close(out, ref, dtype)


def _inputs(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype, gen, device,
            e_local: int | None = None):  # type: ignore[no-untyped-def]
    e_local = e if e_local is None else e_local
    x = torch.randn(t, h, generator=gen).to(dtype=dtype, device=device)
    w13 = (torch.randn(e_local, 2 * inter, h, generator=gen) * h**-0.5).to(dtype=dtype,
                                                                          device=device)
    w2 = (torch.randn(e_local, h, inter, generator=gen) * inter**-0.5).to(dtype=dtype,
                                                                          device=device)
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(device)  # distinct per row
    weights = torch.rand(t, k, generator=gen).to(device)
    return x, w13, w2, weights, ids


def _case(t, h, inter, e, k, dtype, gen, device, close, e_local=None, start=0,
          config=None):  # type: ignore[no-untyped-def]
    from kernels.triton_moe import fused_moe

    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, dtype, gen, device, e_local)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, start).to(dtype)
    out = fused_moe(x, w13, w2, weights, ids, start, config=config)
    assert out.dtype == dtype
    _close(out, ref, dtype, close)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 32, 48, 8, 2), (7, 64, 32, 4, 2),
                                           (21, 48, 40, 8, 3)])
def test_fused_moe(t, h, inter, e, k, dtype, gen, device, close):
    _case(t, h, inter, e, k, dtype, gen, device, close)


def test_fused_moe_many_tokens_per_expert(gen, device, close):
    # 40 tokens x top-2 over 3 experts: each expert's run spans several 16-row tiles
    _case(40, 32, 32, 3, 2, torch.float32, gen, device, close)


@pytest.mark.parametrize("start", [0, 4])
def test_fused_moe_expert_shard_skips_other_ranks(start, gen, device, close):
    # this rank holds experts [start, start + 4) of 8; the rest contribute nothing
    out, ref = _case(9, 32, 32, 8, 3, torch.float32, gen, device, close, e_local=4,
                     start=start)
    assert ref.abs().sum() > 0


def test_fused_moe_top1(gen, device, close):
    _case(5, 32, 32, 4, 1, torch.float32, gen, device, close)


def test_fused_moe_rank_holding_none_of_the_chosen_experts_adds_zeros(gen, device):
    from kernels.triton_moe import fused_moe

    x, w13, w2, weights, _ = _inputs(6, 32, 32, 8, 2, torch.float32, gen, device, e_local=4)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], device=device)
    out = fused_moe(x, w13, w2, weights, ids, 4)  # this rank holds experts 4-7
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("start,e_local", [(0, None), (0, 4), (4, 4)])
def test_fused_moe_one_token_needs_no_align_step(start, e_local, gen, device, close,
                                                 monkeypatch):
    # One token: each tile is one (token, expert) pair read straight from the routing, the
    # align step never runs; an expert shard skips the other ranks' pairs
    import kernels.triton_moe as m

    def no_align(*a, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("align ran for one token")

    monkeypatch.setattr(m, "moe_align_triton", no_align)
    monkeypatch.setattr(m, "moe_align_multi", no_align)
    _case(1, 32, 48, 8, 3, torch.float32, gen, device, close, e_local=e_local,
          start=start)
    monkeypatch.setattr(m, "PER_PAIR_MAX_TOKENS", 0)
    with pytest.raises(AssertionError, match="align ran"):
        _case(1, 32, 48, 8, 3, torch.float32, gen, device, close)


@pytest.mark.parametrize("width", [16, 64])
def test_per_pair_gate_up_width(width, gen, device, close, monkeypatch):
    # PER_PAIR_BLOCK_N (an A/B switch): one token's gate/up grid with narrower or wider
    # column tiles than the table's, the same values (a tile past I, 48, is masked)
    import kernels.triton_moe as m

    grids: list[tuple[int, int]] = []
    kernel = m._gate_up_kernel

    class Grid:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(m, "_gate_up_kernel", Grid())
    monkeypatch.setattr(m, "PER_PAIR_BLOCK_N", width)
    _case(1, 32, 48, 8, 3, torch.float32, gen, device, close)
    _case(2, 32, 48, 8, 3, torch.float32, gen, device, close)  # two tokens: the table's
    table = m.tile_config(2, device)["BLOCK_N"]
    assert grids[0] == (3, -(-48 // width)) and grids[1][1] == -(-48 // table)


def test_fused_moe_wide_tiles(gen, device, close):
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_N_DOWN": 32,
           "BLOCK_K_DOWN": 16, "num_warps": 4, "num_stages": 1}
    _case(10, 48, 40, 4, 2, torch.float32, gen, device, close, config=cfg)


def test_align_layout(device):
    from kernels.triton_moe_align import max_sorted_rows, moe_align

    ids = torch.tensor([[2, 0], [2, 1], [5, 2]], device=device)  # expert 5: another rank's
    sorted_ids, block_expert = moe_align(ids, 4, 0, 4)
    assert sorted_ids.numel() == max_sorted_rows(6, 4, 4) == 20
    n = 6
    # expert 0: pair 1; expert 1: pair 3; expert 2: pairs 0, 2, 5 (stable order)
    assert sorted_ids[:12].tolist() == [1, n, n, n, 3, n, n, n, 0, 2, 5, n]
    assert (sorted_ids[12:] == n).all()
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


@pytest.mark.parametrize("t,k,e,start,e_local,bm", [
    (3, 2, 6, 0, 4, 4), (1, 8, 128, 0, 128, 16), (37, 3, 10, 5, 5, 16), (200, 2, 3, 0, 3, 16)])
def test_align_kernel_equals_torch_align(t, k, e, start, e_local, bm, device):
    from kernels.triton_moe_align import moe_align, moe_align_triton

    gen = torch.Generator().manual_seed(t)
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(device)
    want = moe_align(ids, bm, start, e_local)
    got = moe_align_triton(ids, bm, start, e_local)
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()


def spy_align_forms(monkeypatch, module) -> list[str]:  # type: ignore[no-untyped-def]
    """The names of the align forms `module` calls, in order, as it calls them (its own
    imported names moe_align_triton and moe_align_multi, wrapped)."""
    ran: list[str] = []

    def spying(name: str):  # type: ignore[no-untyped-def]
        f = getattr(module, name)

        def spy(*a, **kw):  # type: ignore[no-untyped-def]
            ran.append(name)
            return f(*a, **kw)
        return spy

    for name in ("moe_align_triton", "moe_align_multi"):
        monkeypatch.setattr(module, name, spying(name))
    return ran


@pytest.mark.parametrize("t", [20, 22])
def test_align_form_by_pair_count(t, gen, device, monkeypatch):
    # Decode-sized calls align in one program up to ALIGN_ONE_PROGRAM_MAX_PAIRS pairs and
    # in moe_align_multi's three launches past it (20 x 6 = 120 pairs, 22 x 6 = 132); the
    # two forms give the same layout, so the output is the same bits either way
    import kernels.triton_moe as m
    import kernels.triton_moe_align as ma

    assert ma.ALIGN_ONE_PROGRAM_MAX_PAIRS == 128
    x, w13, w2, weights, ids = _inputs(t, 32, 48, 16, 6, torch.float32, gen, device)
    ran = spy_align_forms(monkeypatch, m)
    out = m.fused_moe(x, w13, w2, weights, ids)
    assert ran == ["moe_align_triton" if t * 6 <= 128 else "moe_align_multi"]
    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0 if t * 6 <= 128 else 10**6)
    other = m.fused_moe(x, w13, w2, weights, ids)
    assert ran[1] != ran[0]
    assert torch.equal(out, other)


def test_tile_config_buckets():
    from kernels.triton_moe import tile_config

    cuda = torch.device("cuda")
    if torch.cuda.is_available():
        pytest.skip("bucket values below are the 'default' table's")
    assert tile_config(1, torch.device("cpu"))["BLOCK_M"] == 16
    small, big = tile_config(8, torch.device("meta")), tile_config(10**6, torch.device("meta"))
    assert small["BLOCK_M"] <= big["BLOCK_M"]
    del cuda


def test_fused_moe_rejects_bad_shapes(device):
    from kernels.triton_moe import fused_moe

    x = torch.zeros(2, 32, device=device)
    w13 = torch.zeros(4, 48, 32, device=device)
    w2 = torch.zeros(4, 32, 20, device=device)  # I = 24 expected
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2, torch.zeros(2, 2, device=device),
                  torch.zeros(2, 2, dtype=torch.int64, device=device))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 8, 32, 128, 600])
def test_fused_moe_gpu(t, dtype, gen, close):
    # Qwen3-30B-A3B's expert shape: 128 experts, top-8, hidden 2048, intermediate 768
    _case(t, 2048, 768, 128, 8, dtype, gen, torch.device("cuda"), close)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [16, 48])
def test_fused_moe_gpu_expert_shard_and_graph(t, gen, close):
    """Half the experts on this rank, launched from a captured CUDA graph: 96 pairs align
    in one program, 288 in three launches (ALIGN_ONE_PROGRAM_MAX_PAIRS)."""
    from kernels.triton_moe import fused_moe

    dev = torch.device("cuda")
    x, w13, w2, weights, ids = _inputs(t, 1024, 512, 64, 6, torch.bfloat16, gen, dev,
                                       e_local=32)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, 32).to(x.dtype)
    fused_moe(x, w13, w2, weights, ids, 32)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(x, w13, w2, weights, ids, 32)
    ids.copy_(torch.rand(t, 64, generator=gen).argsort(dim=1)[:, :6].to(dev))
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, 32).to(x.dtype)
    g.replay()
    close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("scoring,renorm,bias,scale,round_dtype,k,e", [
    ("softmax", True, False, 1.0, None, 2, 8),
    ("softmax", False, False, 1.0, torch.bfloat16, 8, 128),  # Qwen3-30B-A3B's routing
    ("softmax", False, False, 16.0, None, 6, 64),
    ("sigmoid", True, True, 2.5, None, 8, 256),
    ("sigmoid", False, True, 1.0, None, 3, 10),
])
def test_moe_route_equals_reference(scoring, renorm, bias, scale, round_dtype, k, e, gen,
                                    device):
    from kernels.ref_moe import moe_route_ref
    from kernels.triton_moe_route import moe_route

    logits = (torch.randn(19, e, generator=gen) * 2).to(device)
    b = torch.randn(e, generator=gen).to(device) if bias else None
    args = (logits, k, scoring, renorm, scale, b)
    w, ids = moe_route(*args, round_dtype=round_dtype)
    rw, rids = moe_route_ref(*args, round_dtype=round_dtype)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.sort(dim=1).values, rids.sort(dim=1).values)
    # same experts; compare weights expert by expert
    got = torch.zeros(19, e, device=device).scatter_(1, ids, w)
    want = torch.zeros(19, e, device=device).scatter_(1, rids, rw)
    tol = 1e-2 if round_dtype is not None else 1e-5  # one bf16 rounding apart at most
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-6)


def test_moe_route_rejects_a_bad_scoring_func(device):
    from kernels.triton_moe_route import moe_route

    with pytest.raises(ValueError, match="scoring_func"):
        moe_route(torch.zeros(2, 4, device=device), 2, "tanh", True)


@pytest.mark.parametrize("scoring,bias,scale", [("softmax", False, 1.0),
                                                ("sigmoid", True, 2.5)])
def test_moe_route_appends_shared_experts_unscaled(scoring, bias, scale, gen, device):
    """num_shared S: ids E .. E + S - 1 follow the top-k in every row with weight 1, and
    the routed part is what the call without them returns."""
    from kernels.ref_moe import moe_route_ref
    from kernels.triton_moe_route import moe_route

    e, k, s = 16, 3, 2
    logits = (torch.randn(7, e, generator=gen) * 2).to(device)
    b = torch.randn(e, generator=gen).to(device) if bias else None
    args = (logits, k, scoring, True, scale, b)
    base_w, base_ids = moe_route_ref(*args)
    for fn in (moe_route, moe_route_ref):
        w, ids = fn(*args, num_shared=s)
        assert w.shape == ids.shape == (7, k + s)
        assert torch.equal(ids[:, k:].cpu(), torch.tensor([[e, e + 1]] * 7))
        assert torch.equal(w[:, k:].cpu(), torch.ones(7, s))
        assert torch.equal(ids[:, :k].sort(dim=1).values, base_ids.sort(dim=1).values)
        got = torch.zeros(7, e, device=device).scatter_(1, ids[:, :k], w[:, :k])
        want = torch.zeros(7, e, device=device).scatter_(1, base_ids, base_w)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring,bias,renorm,scale,e,g,tg,k", [
    ("softmax", False, False, 16.0, 16, 4, 2, 4),  # DeepSeek-V2's group_limited_greedy
    ("softmax", False, False, 1.0, 160, 8, 3, 6),  # V2's own shape: 20 experts a group
    ("sigmoid", True, True, 2.5, 16, 4, 2, 4),  # DeepSeek-V3's noaux_tc
    ("sigmoid", True, True, 2.5, 256, 8, 4, 8),  # V3's own shape
    ("sigmoid", True, False, 1.0, 8, 8, 3, 2),  # one expert a group
])
def test_moe_route_with_expert_groups_equals_reference(scoring, bias, renorm, scale, e, g,
                                                       tg, k, gen, device):
    from kernels.ref_moe import moe_route_ref
    from kernels.triton_moe_route import moe_route

    logits = (torch.randn(23, e, generator=gen) * 2).to(device)
    b = torch.randn(e, generator=gen).to(device) if bias else None
    args = (logits, k, scoring, renorm, scale, b)
    w, ids = moe_route(*args, n_group=g, topk_group=tg, num_shared=1)
    rw, rids = moe_route_ref(*args, n_group=g, topk_group=tg, num_shared=1)
    assert torch.equal(ids.sort(dim=1).values, rids.sort(dim=1).values)
    got = torch.zeros(23, e + 1, device=device).scatter_(1, ids, w)
    want = torch.zeros(23, e + 1, device=device).scatter_(1, rids, rw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the picks lie in topk_group groups: the grouping did restrict them
    assert max(len(set((row // (e // g)).tolist())) for row in ids[:, :k].cpu()) <= tg
