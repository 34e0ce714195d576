"""Down projection and top-k sum in one launch (kernels/triton_moe_down_sum.py), through
fused_moe's one-token path with DOWN_SUM_MAX_TOKENS on: the same result as the unfused
down + sum (up to the order of the sum over I), the reference's, and one launch fewer."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kernels.ref_fp8 import quantize_stack
from kernels.ref_moe import fused_moe_ref

# The switch changes the order of each pair's sum over I only: float32 agrees to rounding.
# bf16 rounds each pair's row, where a last-bit difference can flip an element's rounding
# (the close fixture's bound on the GPU). The interpreter's sums come out equal after that
# rounding on these shapes; leaving the rounding out showed 4-6e-3 there.
F32_TOL = 1e-5
INTERP_BF16_SWITCH_TOL = 1e-3
# Against the float32 reference the interpreter's truncating float32 -> bf16 casts add a
# bias (tests/kernels/test_moe.py measured 1.1-1.3% on such shapes).
INTERP_BF16_TOL = 2.5e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(h: int, inter: int, e: int, k: int, shared: int, e_local: int, start: int,
            dtype: torch.dtype, fp8_block: Any, gen: torch.Generator,
            device: torch.device) -> dict[str, Any]:
    """One token routed to k of e experts plus `shared` always-on ones (ids e .. e+S-1,
    weight 1, stacked after the routed experts as the engine stacks them); this rank holds
    local experts [start, start + e_local) of those e + shared."""
    x = torch.randn(1, h, generator=gen).to(dtype=dtype, device=device)
    w13 = torch.randn(e_local, 2 * inter, h, generator=gen) * h**-0.5
    w2 = torch.randn(e_local, h, inter, generator=gen) * inter**-0.5
    # routed experts alternating between other ranks' and this rank's (while both last),
    # so that a shard case always has pairs of both kinds
    mine = [i for i in range(e) if start <= i < start + e_local]
    theirs = [i for i in range(e) if i not in mine]
    pools = [[p[i] for i in torch.randperm(len(p), generator=gen)] for p in (theirs, mine)]
    routed_ids: list[int] = []
    while len(routed_ids) < k:
        pool = pools[len(routed_ids) % 2] or pools[(len(routed_ids) + 1) % 2]
        routed_ids.append(pool.pop())
    routed = torch.tensor([routed_ids])
    ids = torch.cat([routed, torch.arange(e, e + shared).view(1, shared)], dim=1)
    weights = torch.cat([torch.rand(1, k, generator=gen), torch.ones(1, shared)], dim=1)
    args: dict[str, Any] = dict(topk_weights=weights.to(device), topk_ids=ids.to(device),
                                expert_start=start)
    if fp8_block == "none":
        args.update(w13=w13.to(dtype=dtype, device=device), w2=w2.to(dtype=dtype, device=device))
    else:
        q13, s13 = quantize_stack(w13, fp8_block)
        q2, s2 = quantize_stack(w2, fp8_block)
        args.update(w13=q13.to(device), w2=q2.to(device), w13_scale=s13.to(device),
                    w2_scale=s2.to(device))
    return dict(x=x, **args)


def _moe(args: dict[str, Any], fused: bool, monkeypatch: pytest.MonkeyPatch,
         switch: str = "DOWN_SUM_MAX_TOKENS") -> torch.Tensor:
    """fused_moe with one of kernels/triton_moe.py's one-token switches on (1) or off (0):
    this file's, or test_moe_gate_up_gemv.py's GATE_UP_GEMV_MAX_TOKENS."""
    import kernels.triton_moe as m

    monkeypatch.setattr(m, switch, 1 if fused else 0)
    return m.fused_moe(**args)


def _check(args: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
           close: Callable[[torch.Tensor, torch.Tensor, torch.dtype], None],
           switch: str = "DOWN_SUM_MAX_TOKENS") -> None:
    """The switch's one-token path against the path without it and the float32
    reference."""
    off = _moe(args, False, monkeypatch, switch)
    on = _moe(args, True, monkeypatch, switch)
    dtype = args["x"].dtype
    assert on.dtype == dtype and on.shape == off.shape
    assert torch.isfinite(on).all(), "non-finite output: an element was not written"
    ref_args = dict(args, x=args["x"].float())
    if "w13_scale" not in args:
        ref_args.update(w13=args["w13"].float(), w2=args["w2"].float())
    ref = fused_moe_ref(**ref_args)
    assert ref.abs().sum() > 0  # some pair is this rank's
    if dtype == torch.float32:
        assert _rel(on, off) < F32_TOL, _rel(on, off)
        assert _rel(on, ref) < 2e-5, _rel(on, ref)
    else:
        close(on, off, dtype)
        if not on.is_cuda:
            assert _rel(on, off) < INTERP_BF16_SWITCH_TOL, _rel(on, off)
        if on.is_cuda:
            close(on, ref.to(dtype), dtype)
        else:
            assert _rel(on, ref) < INTERP_BF16_TOL, _rel(on, ref)


# (h, inter, e, k, shared, e_local, start): H and I off the tiles (masks, the moved-back
# last K tile), shared experts among the pairs, and a rank holding part of the experts
SHAPES = [
    (32, 48, 8, 2, 0, 8, 0),  # I = 48: a 32-column tile, then one moved back by 16
    (40, 64, 6, 3, 2, 8, 0),  # H = 40: the last column tile wraps; 2 shared experts
    (48, 40, 8, 3, 1, 5, 4),  # this rank: routed experts 4-7 and the shared one
    (24, 32, 8, 4, 0, 4, 0),  # experts 0-3 only: the other rank's pairs skipped
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,inter,e,k,shared,e_local,start", SHAPES)
def test_down_sum_equals_unfused(h, inter, e, k, shared, e_local, start, dtype, gen, device,
                                 monkeypatch, close):
    _check(_inputs(h, inter, e, k, shared, e_local, start, dtype, "none", gen, device),
           monkeypatch, close)


@pytest.mark.parametrize("inter", [48, 40])  # whole 16-column tiles; a moved-back last one
def test_down_sum_many_k_tiles(inter, gen, device, monkeypatch, close):
    # 16-column K tiles: several per pair, the loop over (pair, K tile) crossing pairs
    import kernels.triton_moe_down_sum as ds

    monkeypatch.setattr(ds, "BLOCK_K", 16)
    _check(_inputs(40, inter, 8, 3, 1, 9, 0, torch.float32, "none", gen, device),
           monkeypatch, close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, (32, 32), (16, 16)])
def test_down_sum_fp8_experts(block, dtype, gen, device, monkeypatch, close):
    # per-channel scales (once on each pair's sum) and block scales (per K tile: I = 64 in
    # two or four groups; the tile narrows to the group)
    _check(_inputs(32, 64, 8, 3, 1, 9, 0, dtype, block, gen, device), monkeypatch, close)


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_down_sum_fp8_expert_shard(block, gen, device, monkeypatch, close):
    _check(_inputs(64, 64, 8, 3, 0, 4, 4, torch.float32, block, gen, device), monkeypatch,
           close)


def test_down_sum_rank_holding_none_of_the_pairs_adds_zeros(gen, device, monkeypatch):
    args = _inputs(32, 32, 8, 2, 0, 4, 0, torch.float32, "none", gen, device)
    args["topk_ids"] = torch.tensor([[5, 6]], device=device)  # experts of another rank
    out = _moe(args, True, monkeypatch)
    assert torch.equal(out, torch.zeros_like(out))


def test_down_sum_tokens_and_int32_ids(gen, device):
    # the launcher itself at 3 tokens (a grid row each), int32 ids, against its contract:
    # each pair's row rounded to bf16, weighted in float32, summed in slot order
    from kernels.triton_moe_down_sum import down_sum

    t, k, h, inter, e = 3, 2, 24, 32, 4
    act = torch.randn(t * k, inter, generator=gen).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter**-0.5).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [3, 1], [5, 2]], dtype=torch.int32)  # 5: another rank's
    weights = torch.rand(t, k, generator=gen)
    ref = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            if ids[i, j] < e:
                row = (act[i * k + j].float() @ w2[ids[i, j]].float().t()).bfloat16()
                ref[i] += row.float() * weights[i, j]
    out = torch.empty(t, h, dtype=torch.bfloat16, device=device)
    down_sum(act.to(device), w2.to(device), ids.to(device), weights.to(device), out)
    assert _rel(out.cpu(), ref.bfloat16()) < 1e-2, _rel(out.cpu(), ref.bfloat16())


@contextmanager
def _launches() -> Iterator[collections.Counter[str]]:
    """Counts Triton launches by kernel name (interpreted or compiled), as
    bench/decode_op_count.py does."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counts: collections.Counter[str] = collections.Counter()
    saved = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup"):
                counts[self.fn.__name__] += 1
            return run(self, *args, **kwargs)
        return counted

    for cls, run in saved.items():
        cls.run = wrap(run)  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for cls, run in saved.items():
            cls.run = run  # type: ignore[method-assign]


def test_down_sum_saves_the_sum_launch(gen, device, monkeypatch):
    args = _inputs(32, 32, 8, 2, 1, 9, 0, torch.float32, "none", gen, device)
    with _launches() as off:
        _moe(args, False, monkeypatch)
    with _launches() as on:
        _moe(args, True, monkeypatch)
    assert off == {"_gate_up_kernel": 1, "_down_kernel": 1, "_sum_topk_kernel": 1}, off
    assert on == {"_gate_up_kernel": 1, "_down_sum_kernel": 1}, on
    assert sum(on.values()) == sum(off.values()) - 1


# the one-token switches of kernels/triton_moe.py: (switch, its kernel, the one it replaces)
ONE_TOKEN_SWITCHES = [("DOWN_SUM_MAX_TOKENS", "_down_sum_kernel", "_sum_topk_kernel"),
                      ("GATE_UP_GEMV_MAX_TOKENS", "_gate_up_gemv_kernel", "_gate_up_kernel")]


@pytest.mark.parametrize("switch,fused,kept", ONE_TOKEN_SWITCHES)
def test_past_one_token_keeps_the_unfused_path(switch, fused, kept, gen, device,
                                               monkeypatch):
    # two tokens take the align step's layout, where neither switch applies
    import kernels.triton_moe as m

    args = _inputs(32, 32, 8, 2, 0, 8, 0, torch.float32, "none", gen, device)
    args.update(x=args["x"].repeat(2, 1), topk_ids=args["topk_ids"].repeat(2, 1),
                topk_weights=args["topk_weights"].repeat(2, 1))
    monkeypatch.setattr(m, switch, 1)
    with _launches() as counts:
        m.fused_moe(**args)
    assert counts[kept] == 1 and fused not in counts, counts


def _valid_args(device: torch.device) -> tuple[torch.Tensor, ...]:
    """down_sum's act, w2, topk_ids, topk_weights and out for 2 tokens of 2 pairs (I = 32,
    H = 16): arguments it accepts, for the refusal tests to spoil one at a time."""
    return (torch.zeros(4, 32, device=device), torch.zeros(3, 16, 32, device=device),
            torch.zeros(2, 2, dtype=torch.int64, device=device),
            torch.zeros(2, 2, device=device), torch.empty(2, 16, device=device))


def test_down_sum_bad_arguments_are_refused(device):
    from kernels.triton_moe_down_sum import down_sum

    act, w2, ids, wts, out = _valid_args(device)
    with pytest.raises(ValueError, match=r"act: expected \(4, 32\)"):
        down_sum(act[:3], w2, ids, wts, out)
    with pytest.raises(ValueError, match=r"out: expected \(2, 16\)"):
        down_sum(act, w2, ids, wts, out[:1])
    with pytest.raises(ValueError, match="topk_weights: expected float32"):
        down_sum(act, w2, ids, wts.double(), out)
    with pytest.raises(ValueError, match="topk_ids: expected int32/int64"):
        down_sum(act, w2, ids.float(), wts, out)
    with pytest.raises(ValueError, match="w2: expected act's dtype"):
        down_sum(act, w2.bfloat16(), ids, wts, out)
    with pytest.raises(ValueError, match="w2: w2_scale given, expected float8_e4m3fn"):
        down_sum(act, w2, ids, wts, out, w2_scale=torch.ones(3, 16, 1, device=device))
    q2 = w2.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="w2_scale: 3 scale groups"):
        down_sum(act, q2, ids, wts, out, w2_scale=torch.ones(3, 16, 3, device=device))
    with pytest.raises(ValueError, match=r"w2_scale: expected \[3, 16, G\]"):
        down_sum(act, q2, ids, wts, out, w2_scale=torch.ones(3, 8, 1, device=device))
