"""The fused MoE kernel's grouped-GEMM form (kernels/moe_grouped_gemm.py: torch's grouped
GEMM on expert-sorted rows) against the torch reference: its rows summed through the row
map as fused_moe sums them (interpreter and torch's CPU grouped GEMM on CPU, CUTLASS with
-m gpu), the per-expert run ends, and on the GPU fused_moe's choice of it."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_moe import fused_moe_ref
from tests.kernels.test_moe import INTERP_BF16_TOL, _inputs, spy_align_forms

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"),
                                      reason="this torch has no torch._grouped_mm")


def _rows_summed(x, w13, w2, weights, ids, start):  # type: ignore[no-untyped-def]
    import kernels.triton_moe as m
    from kernels.moe_grouped_gemm import expert_rows_grouped

    ids = ids.contiguous()
    ys, row_of_pair = expert_rows_grouped(x, w13, w2, ids, start)
    assert ys.shape[1] == x.shape[1] and row_of_pair.shape == (ids.numel(),)
    out = torch.empty_like(x)
    m._sum_topk(ys, ids, weights, out, start, w13.shape[0], False, row_of_pair=row_of_pair)
    return out


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "a row the sum reads was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@needs_grouped_mm
@pytest.mark.parametrize("t,h,inter,e,k,start,e_local", [
    (40, 32, 48, 6, 2, 0, None),
    (37, 48, 40, 8, 3, 0, None),  # runs of every length mod 16: padding rows in each
    (50, 32, 32, 8, 3, 4, 4),  # this rank holds experts 4-7: the others' pairs skipped
    (50, 32, 32, 8, 3, 0, 4),
])
@pytest.mark.parametrize("align", ["single", "multi", "multi-then-offsets"])
def test_grouped_form_equals_reference(t, h, inter, e, k, start, e_local, align, gen, device,
                                       monkeypatch):
    # "multi": the three-launch align, whose place kernel writes the run ends and the row
    # map itself (past ALIGN_ONE_PROGRAM_MAX_PAIRS pairs); "single": the one-program align,
    # then expert_offsets and the row-map kernel; "multi-then-offsets": RUNS_FROM_ALIGN off
    import kernels.moe_grouped_gemm as mg
    import kernels.triton_moe_align as ma

    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 10**6 if align == "single" else 0)
    monkeypatch.setattr(mg, "RUNS_FROM_ALIGN", align == "multi")
    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, torch.bfloat16, gen, device, e_local)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, start)
    out = _rows_summed(x, w13, w2, weights, ids, start)
    assert out.dtype == torch.bfloat16
    assert _err(out, ref) < INTERP_BF16_TOL


@needs_grouped_mm
@pytest.mark.parametrize("align", ["single", "multi", "multi-then-offsets"])
def test_grouped_form_with_empty_experts(align, gen, device, monkeypatch):
    """Every pair routed to experts 1 and 4 of 6: the other experts' runs are empty (equal
    offsets), and the two runs span several gather tiles each."""
    import kernels.moe_grouped_gemm as mg
    import kernels.triton_moe_align as ma

    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 10**6 if align == "single" else 0)
    monkeypatch.setattr(mg, "RUNS_FROM_ALIGN", align == "multi")
    x, w13, w2, weights, _ = _inputs(45, 32, 32, 6, 2, torch.bfloat16, gen, device)
    ids = torch.tensor([[1, 4]] * 45, dtype=torch.int32, device=device)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, 0)
    assert _err(_rows_summed(x, w13, w2, weights, ids, 0), ref) < INTERP_BF16_TOL


@needs_grouped_mm
def test_top2_prefill_aligns_in_three_launches(gen, device, monkeypatch):
    """The grouped form reads the align's one bound (kernels.triton_moe_align.one_program),
    as fused_moe's decode path does: a top-2 routing at the form's 1,024 tokens is 2,048
    pairs, which took one program walking them in series while this form had its own bound
    of 2,048; now the three launches, the run ends and row map from the place kernel."""
    import kernels.moe_grouped_gemm as mg

    ran = spy_align_forms(monkeypatch, mg)
    x, w13, w2, weights, ids = _inputs(1024, 32, 32, 8, 2, torch.bfloat16, gen, device)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, 0)
    assert _err(_rows_summed(x, w13, w2, weights, ids, 0), ref) < INTERP_BF16_TOL
    assert ran == ["moe_align_multi"]


def test_expert_offsets_end_each_padded_run(device):
    from kernels.moe_grouped_gemm import expert_offsets

    # 4 local experts: expert 0 two tiles, expert 1 none, expert 2 one, expert 3 three;
    # then two tiles past the runs
    bexp = torch.tensor([0, 0, 2, 3, 3, 3, -1, -1], dtype=torch.int32, device=device)
    offs = expert_offsets(bexp, 4, 16)
    assert offs.dtype == torch.int32
    assert offs.tolist() == [32, 32, 48, 96]


# The prefill forms fused_moe may take, and the activation dtype each refuses beside FP8
FORMS = [("kernels.moe_grouped_gemm", torch.float16), ("kernels.triton_moe_tma", torch.float32)]


@pytest.mark.parametrize("name", [f for f, _ in FORMS])
def test_prefill_forms_are_for_prefill_sizes_only(name):
    import importlib

    mod = importlib.import_module(name)
    assert mod.MIN_TOKENS is None or mod.MIN_TOKENS > 256  # decode sizes keep the graphs'


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name,refused", FORMS)
def test_prefill_forms_apply_to_their_dtypes_past_min_tokens(name, refused, monkeypatch):
    import importlib

    mod = importlib.import_module(name)
    dev = torch.device("cuda")
    x = torch.zeros(4096, 64, dtype=torch.bfloat16, device=dev)
    w13 = torch.zeros(4, 96, 64, dtype=torch.bfloat16, device=dev)
    w2 = torch.zeros(4, 64, 48, dtype=torch.bfloat16, device=dev)
    monkeypatch.setattr(mod, "MIN_TOKENS", 1024)
    assert mod.applies(x, w13, w2, False, 4096) == getattr(mod, "available", lambda: True)()
    assert not mod.applies(x, w13, w2, False, 1000)  # under MIN_TOKENS
    assert not mod.applies(x, w13, w2, True, 4096)  # FP8 experts
    assert not mod.applies(x.to(refused), w13.to(refused), w2.to(refused), False, 4096)


# each form's entry point in kernels/triton_moe, and the other form, turned off for the test
PICKS = [("kernels.moe_grouped_gemm", "expert_rows_grouped", "kernels.triton_moe_tma"),
         ("kernels.triton_moe_tma", "expert_rows", "kernels.moe_grouped_gemm")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("start,e_local", [(0, 66), (32, 32)])
@pytest.mark.parametrize("name,entry,other", PICKS)
def test_fused_moe_takes_each_prefill_form_past_min_tokens(name, entry, other, start, e_local,
                                                          gen, close, monkeypatch):
    """DeepSeek-V2-Lite's experts (2 shared folded in: 66) at a prefill size, through
    fused_moe with the form's MIN_TOKENS set: the reference's values, and the decode form's
    up to accumulation order (all round gate, up and the activation at the same points)."""
    import importlib

    import kernels.triton_moe as m

    if name == "kernels.moe_grouped_gemm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    form = importlib.import_module(name)
    monkeypatch.setattr(importlib.import_module(other), "MIN_TOKENS", None)
    dev = torch.device("cuda")
    x, w13, w2, weights, ids = _inputs(1100, 2048, 1408, 66, 6, torch.bfloat16, gen, dev,
                                       e_local=e_local)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, start)
    decode_form = m.fused_moe(x, w13, w2, weights, ids, start,
                              config=m.tile_config(1100, dev))
    monkeypatch.setattr(form, "MIN_TOKENS", 1024)
    calls = []
    real = getattr(m, entry)
    monkeypatch.setattr(m, entry, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = m.fused_moe(x, w13, w2, weights, ids, start)
    assert calls == [1]
    close(out, ref.to(torch.bfloat16), torch.bfloat16)
    assert _err(out, decode_form.float()) < 1e-2
    monkeypatch.setattr(form, "MIN_TOKENS", 2048)
    calls.clear()
    m.fused_moe(x, w13, w2, weights, ids, start)
    assert calls == []
