"""Prefill attention's fixed-grid launch (what a CUDA graph of a short prefill step replays,
engine/prefill_graphs.py): lengths only on the device, splits sized from the block table's
capacity, padding query rows after cu[B]. Against the torch reference on CPU (Triton's
interpreter, tiny shapes) and on the GPU at Llama-3-8B's heads."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_attention import prefill_attention_ref
from tests.kernels.test_attention import _rand, needs_cuda, prefill_inputs

TILES = {"block_m": 16, "block_n": 16}


def _padded_case(reqs, pad, bs, hkv, g, d, dtype, gen, device, capacity_blocks):
    """A step's inputs with `pad` padding query rows (random, as a graph's stale rows may
    be) after the real ones, and block tables widened to `capacity_blocks` (their tails
    point at other requests' blocks)."""
    q, kv, table, cu, seq_lens = prefill_inputs(reqs, bs, hkv, g, d, dtype, gen, device)
    extra = table[:, :1].expand(-1, capacity_blocks - table.shape[1])
    table = torch.cat([table, extra], dim=1).contiguous()
    q_pad = torch.cat([q, _rand((pad, *q.shape[1:]), dtype, gen, device)])
    return q, q_pad, kv, table, cu, seq_lens


def _fixed(q_pad, kv, table, cu, seq_lens, scale, **kw) -> torch.Tensor:
    from kernels.triton_prefill_attention import prefill_attention

    out = torch.full_like(q_pad, float("nan"))  # a row nothing wrote stays NaN
    res = prefill_attention(q_pad, kv, table, cu, seq_lens, scale, out=out, fixed_grid=True,
                            **kw)
    assert res is out
    return out


# (cached tokens, chunk length) per request, padding rows: a chunk mid-block after a short
# prefix (one split holds it all, the rest idle), a context of several least-size runs, a
# fresh prompt whose padding fills a whole query tile, two requests, no padding at all.
CASES = [
    ([(37, 5)], 11),
    ([(600, 16)], 16),
    ([(0, 20)], 28),
    ([(21, 40), (9, 3)], 21),
    ([(48, 16)], 0),
]


@pytest.mark.parametrize("reqs,pad", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
def test_fixed_grid_matches_reference(reqs, pad, num_splits, gen, device, close):
    q, q_pad, kv, table, cu, seq_lens = _padded_case(reqs, pad, 16, 2, 2, 32, torch.float32,
                                                     gen, device, capacity_blocks=64)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.2)
    out = _fixed(q_pad, kv, table, cu, seq_lens, 0.2, num_splits=num_splits, **TILES)
    n = q.shape[0]
    close(out[:n], ref, torch.float32)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padding rows: zeros


def test_fixed_grid_in_bfloat16(gen, device, close):
    q, q_pad, kv, table, cu, seq_lens = _padded_case([(300, 9)], 7, 16, 1, 4, 64,
                                                     torch.bfloat16, gen, device, 32)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.125)
    out = _fixed(q_pad, kv, table, cu, seq_lens, 0.125, num_splits=4, **TILES)
    close(out[:9], ref, torch.bfloat16)
    assert not out[9:].any()


def test_one_launch_serves_every_length(gen, device, close):
    """A graph's replays: the same tensors and launch arguments, only the lengths in device
    memory change between calls (and the rows past the chunk become padding)."""
    q, q_pad, kv, table, cu, seq_lens = _padded_case([(500, 30)], 2, 16, 1, 2, 32,
                                                     torch.float32, gen, device, 64)
    for cached, n in [(500, 30), (0, 7), (250, 16), (17, 1), (499, 31)]:
        cu.copy_(torch.tensor([0, n], dtype=torch.int32))
        seq_lens.copy_(torch.tensor([cached + n], dtype=torch.int32))
        ref = prefill_attention_ref(q_pad[:n], kv, table, cu, seq_lens, 0.3)
        out = _fixed(q_pad, kv, table, cu, seq_lens, 0.3, num_splits=5, **TILES)
        close(out[:n], ref, torch.float32)
        assert not out[n:].any()


def test_reference_zeroes_the_padding_rows(gen, device):
    q, q_pad, kv, table, cu, seq_lens = _padded_case([(21, 4), (0, 6)], 5, 16, 1, 2, 32,
                                                     torch.float32, gen, device, 8)
    want = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.5)
    out = torch.full_like(q_pad, float("nan"))
    prefill_attention_ref(q_pad, kv, table, cu, seq_lens, 0.5, out=out, fixed_grid=True)
    assert torch.equal(out[:10], want) and not out[10:].any()


def test_fixed_grid_splits_from_the_table_capacity(gen, device, close, monkeypatch):
    # One 16-query tile, one head, 1,024 tokens of table: the capacity gives 4 splits (the
    # interpreter counts 4 SMs) where a 40-token context would give none. Each split run
    # holds at least MIN_SPLIT_KEYS keys, so split 0 takes all 40 and the other 3 exit
    # without writing a partial output, which the merge then does not read.
    import kernels.triton_prefill_attention as tpa
    from kernels.triton_prefill_split import choose_prefill_splits

    calls: list[tuple[int, bool]] = []
    made: list[tuple[torch.Tensor, torch.Tensor]] = []
    merge, partials = tpa.merge_splits, tpa.partials

    def spy(part_o, part_lse, out, num_splits, skip_empty=False):
        calls.append((num_splits, skip_empty))
        merge(part_o, part_lse, out, num_splits, skip_empty)

    def nan_partials(*a):
        made.append(partials(*a))
        for t in made[-1]:
            t.fill_(float("nan"))  # what no program wrote stays NaN
        return made[-1]

    monkeypatch.setattr(tpa, "merge_splits", spy)
    monkeypatch.setattr(tpa, "partials", nan_partials)
    q, q_pad, kv, table, cu, seq_lens = _padded_case([(30, 10)], 6, 16, 1, 1, 32,
                                                     torch.float32, gen, device, 64)
    assert choose_prefill_splits(1, 1, 1024, device) == 4
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 0.25)
    out = _fixed(q_pad, kv, table, cu, seq_lens, 0.25, **TILES)
    assert calls == [(4, True)]
    close(out[:10], ref, torch.float32)
    part_o, part_lse = made[0]
    part_o, part_lse = part_o.view(4, 16, 32), part_lse.view(4, 16)
    assert torch.isfinite(part_o[0, :10]).all() and part_o[1:].isnan().all()
    assert torch.isfinite(part_lse[0, :10]).all()
    assert (part_lse[0, 10:] == float("-inf")).all() and (part_lse[1:] == float("-inf")).all()


def test_fixed_grid_takes_no_host_bound(device):
    from kernels.triton_prefill_attention import prefill_attention

    q = torch.zeros(4, 2, 32, device=device)
    kv = torch.zeros(2, 2, 16, 1, 32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_seq_len"):
        prefill_attention(q, kv, table, cu, lens, 1.0, max_seq_len=4, fixed_grid=True)


def test_engine_dispatch_passes_the_fixed_grid(gen, device, close, monkeypatch):
    # PagedAttention with a graph step's metadata (no host bound, fixed_grid): the store
    # skips the padding rows (slot -1), the launch is fixed-grid, same rows as the reference
    import kernels.triton_prefill_attention as tpa
    from engine.attention import AttentionMetadata, KernelSet, PagedAttention, kernels_for
    from engine.rope import cos_sin_table
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_norm import rms_norm, rope
    from kernels.triton_store_kv import store_kv
    from tests.kernels.test_attention import paged_kv

    seen: list[bool] = []
    launch = tpa.prefill_attention

    def spy(*a, **kw):
        seen.append(kw["fixed_grid"])
        return launch(*a, **kw)

    tri = KernelSet(store_kv, spy, decode_attention, rms_norm, rope, "triton", lambda x: x)
    cached, n, pad, bs, d = 40, 9, 7, 16, 32
    kv, table = paged_kv([cached + n], bs, 1, d, torch.float32, gen, device)
    table = torch.cat([table, table.new_zeros(1, 64 - table.shape[1])], dim=1)
    pos = torch.arange(cached, cached + n, device=device)
    slots = table[0].long()[pos // bs] * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots, slots.new_full((pad,), -1)]), block_tables=table,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([cached + n], dtype=torch.int32, device=device),
        decode_only=False, fixed_grid=True)
    q = _rand((n + pad, 2, d), torch.float32, gen, device)
    k = _rand((n + pad, 1, d), torch.float32, gen, device)
    v = _rand((n + pad, 1, d), torch.float32, gen, device)
    positions = torch.cat([pos, pos.new_zeros(pad)])
    cs = cos_sin_table(d, 1024, 10000.0, None).to(device)
    want_kv = kv.clone()
    want = PagedAttention(kernels_for(device, force_reference=True), d ** -0.5)(
        q, k, v, want_kv, meta, positions, cs)
    got = PagedAttention(tri, d ** -0.5)(q, k, v, kv, meta, positions, cs)
    assert seen == [True]
    assert torch.equal(kv, want_kv)  # the same slots written, padding rows none
    close(got[:n], want[:n], torch.float32)
    assert not got[n:].any() and not want[n:].any()


SM90_BODY = r'''
import kernels.triton_prefill_attention as pre

SIG = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "cu_ptr": "*i32",
       "lens_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
       "s_qt": "i32", "s_qh": "i32", "s_cb": "i64", "s_ckv": "i32", "s_cs": "i32",
       "s_ch": "i32", "s_btb": "i32", "s_ot": "i32", "s_oh": "i32", "qk_scale": "fp32",
       "v_scale": "fp32", "num_reqs": "i32", "search_steps": "i32", "num_tokens": "i32"}
for block_m, warps in ((pre.BLOCK_M, pre.NUM_WARPS), (pre.SHORT_BLOCK_M, pre.SHORT_NUM_WARPS)):
    for split in (False, True):
        for fixed in (False, True):
            out[f"{block_m}/split{int(split)}/fixed{int(fixed)}"] = spills(
                pre._prefill_kernel, SIG, dict(
                    G=4, D=128, BS=16, BLOCK_M=block_m, BLOCK_N=pre.BLOCK_N,
                    COMPUTE=tl.bfloat16, IEEE=False, SPLIT=split, FIXED=fixed, LEAST=256),
                num_warps=warps, num_stages=pre.NUM_STAGES)
'''


@pytest.mark.slow
def test_fixed_grid_spills_no_more_than_the_eager_kernel_on_sm90():
    # Llama-3-8B's heads at the launcher's tiles, compiled for an H200 without a GPU: the
    # graph variant's extra branches cost at most 64 bytes of spill over the eager kernel's
    # (measured, ptxas 2026-12: 128-row tiles 252 -> 260 unsplit, 80 -> 56 split).
    from sm90_spills import spill_bytes

    found = spill_bytes(SM90_BODY)
    assert len(found) == 8, sorted(found)
    for key, eager in found.items():
        if key.endswith("fixed0"):
            assert found[key[:-1] + "1"] <= eager + 64, found


# --- GPU, Llama-3-8B heads --------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("reqs,pad", [
    ([(2048, 128)], 0),  # the cached-prefix question the graphs are for
    ([(2000, 100)], 28),  # padded to the 128 bucket
    ([(0, 5)], 11),  # a fresh short prompt in the 16 bucket
    ([(3900, 150)], 106),  # the 256 bucket near a 4,096-token table's end
    ([(16, 256)], 0),
])
def test_fixed_grid_gpu(reqs, pad, gen, close):
    dev = torch.device("cuda")
    q, q_pad, kv, table, cu, seq_lens = _padded_case(reqs, pad, 16, 8, 4, 128, torch.bfloat16,
                                                     gen, dev, capacity_blocks=256)
    ref = prefill_attention_ref(q, kv, table, cu, seq_lens, 128 ** -0.5)
    out = _fixed(q_pad, kv, table, cu, seq_lens, 128 ** -0.5)
    n = q.shape[0]
    close(out[:n], ref, torch.bfloat16)
    assert not out[n:].any()


@pytest.mark.gpu
@needs_cuda
def test_fixed_grid_in_a_cuda_graph_gpu(gen, close):
    """Captured once, replayed over lengths written into the same device buffers."""
    dev = torch.device("cuda")
    q, q_pad, kv, table, cu, seq_lens = _padded_case([(2048, 128)], 0, 16, 8, 4, 128,
                                                     torch.bfloat16, gen, dev, 256)
    out = torch.zeros_like(q_pad)

    def step() -> None:
        from kernels.triton_prefill_attention import prefill_attention

        prefill_attention(q_pad, kv, table, cu, seq_lens, 128 ** -0.5, out=out,
                          fixed_grid=True)

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for cached, n in [(2048, 128), (0, 100), (3000, 17), (1, 128)]:
        cu.copy_(torch.tensor([0, n], dtype=torch.int32))
        seq_lens.copy_(torch.tensor([cached + n], dtype=torch.int32))
        graph.replay()
        ref = prefill_attention_ref(q_pad[:n], kv, table, cu, seq_lens, 128 ** -0.5)
        close(out[:n], ref, torch.bfloat16)
        assert not out[n:].any()
