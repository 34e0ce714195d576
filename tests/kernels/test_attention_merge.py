"""Decode attention's fused split merge: the last split program of each (request, KV head)
merges the splits through a per-pair counter, instead of a second kernel."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_attention import decode_attention_ref
from tests.kernels.test_attention import _rand, needs_cuda, paged_kv


def _case(lens: list[int], hkv: int, g: int, d: int, dtype: torch.dtype, gen, device):
    kv, table = paged_kv(lens, 16, hkv, d, dtype, gen, device)
    q = _rand((len(lens), hkv * g, d), dtype, gen, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kv, table, seq_lens


def test_fused_merge_equals_the_merge_kernel_over_several_chunks(gen, device, close):
    # 20 splits of 16 tokens: more than MERGE_CHUNK (16), so the merger takes two passes;
    # the short requests use 1 and 3 splits, and the programs past them write nothing.
    from kernels import triton_decode_attention as tda

    lens = [20 * 16, 40, 1, 20 * 16 - 5, 0]  # 0: a graph's padding row, which gets zeros
    q, kv, table, seq_lens = _case(lens, 2, 3, 64, torch.float32, gen, device)
    ref = decode_attention_ref(q, kv, table, seq_lens, 0.125)
    kw = dict(num_splits=20, block_n=16, max_seq_len=max(lens))
    plain = tda.decode_attention(q, kv, table, seq_lens, 0.125, fused_merge=False, **kw)
    outs = []
    for _ in range(3):  # the counters must be zero again after each launch
        out = torch.full_like(q, float("nan"))
        tda.decode_attention(q, kv, table, seq_lens, 0.125, out=out, fused_merge=True, **kw)
        assert int(tda._counters[q.device].count_nonzero()) == 0
        outs.append(out)
    assert torch.equal(outs[0][-1], torch.zeros_like(outs[0][-1]))
    assert torch.equal(plain[-1], torch.zeros_like(plain[-1]))
    close(outs[0][:-1], ref[:-1], torch.float32)
    close(plain[:-1], ref[:-1], torch.float32)
    assert torch.allclose(outs[0], plain, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_fused_merge_with_per_request_splits_and_a_wide_table(gen, device, close):
    # No max_seq_len hint (as inside a CUDA graph): each request sizes its own splits.
    from kernels import triton_decode_attention as tda

    lens = [300, 17, 64, 1]
    q, kv, table, seq_lens = _case(lens, 1, 2, 64, torch.bfloat16, gen, device)
    table = torch.cat([table, table.new_zeros(len(lens), 30)], dim=1)
    ref = decode_attention_ref(q, kv, table, seq_lens, 0.125)
    out = tda.decode_attention(q, kv, table, seq_lens, 0.125, num_splits=6, block_n=16,
                               fused_merge=True)
    close(out, ref, torch.bfloat16)
    assert int(tda._counters[q.device].count_nonzero()) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,hkv,max_len", [(1, 8, 512), (1, 8, 8192), (64, 8, 2048),
                                               (256, 8, 1024)])
def test_fused_merge_in_a_cuda_graph_replayed_with_new_lengths(batch, hkv, max_len, gen,
                                                               close):
    # Replays reuse the counters: a counter left non-zero, or partials read before another
    # program's stores landed, shows as a wrong row on some replay.
    from kernels import triton_decode_attention as tda

    dev = torch.device("cuda")
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    q, kv, table, seq_lens = _case(lens, hkv, 4, 128, torch.bfloat16, gen, dev)
    out = torch.empty_like(q)
    tda.decode_attention(q, kv, table, seq_lens, 0.088, out=out)  # warm-up: compiles, allocates
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tda.decode_attention(q, kv, table, seq_lens, 0.088, out=out)
    for i in range(20):
        new = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
        seq_lens.copy_(new.to(dev))
        q.copy_(_rand(tuple(q.shape), torch.bfloat16, gen, dev))
        graph.replay()
        ref = decode_attention_ref(q, kv, table, seq_lens, 0.088)
        plain = tda.decode_attention(q, kv, table, seq_lens, 0.088, fused_merge=False)
        torch.cuda.synchronize()
        close(out, ref, torch.bfloat16)
        assert torch.allclose(out.float(), plain.float(), rtol=1e-2, atol=1e-2), f"replay {i}"
        assert int(tda._counters[q.device].count_nonzero()) == 0


def test_few_pairs_cap_their_splits_so_the_merge_fuses(device):
    # A graph's grid is sized for the table's capacity; with few (request, KV head) pairs the
    # split count is capped at FEW_PAIRS_MAX_SPLITS, within FUSED_MAX_SPLITS.
    from kernels import triton_decode_attention as tda

    assert 0 < tda.FEW_PAIRS_MAX_SPLITS <= tda.FUSED_MAX_SPLITS
    wide = 10_000  # programs per SM: enough that the SM count does not bind
    assert tda.choose_num_splits(1, 8, 1 << 20, device, wide) == tda.FEW_PAIRS_MAX_SPLITS
    assert tda.choose_num_splits(1, 8, 512, device, wide) == 512 // tda.FEW_PAIRS_MIN_SPLIT_TOKENS
    many = tda.choose_num_splits(64, 8, 1 << 20, device, wide)  # not few pairs: no cap
    assert many == -(-wide * tda._num_sms(device) // (64 * 8)) > tda.FEW_PAIRS_MAX_SPLITS
