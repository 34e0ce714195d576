"""The transposed form of GQA decode over a float8 cache (kernels/triton_decode_attention_t.py,
chosen by ``triton_decode_attention.FP8_FORM``) against the reference on the same float8
bytes: Triton's interpreter at small shapes, the GPU at Llama-3-8B's. Each call's launches
of the form are counted: the dispatcher falls back to the pointer form where the form does
not fit, and a silent fall back would pass every value check."""

from __future__ import annotations

import pytest
import torch

import kernels.triton_decode_attention as dec
import kernels.triton_decode_attention_t as dect
from kernels.ref_attention import decode_attention_ref
from tests.kernels.test_kv_fp8 import K_SCALE, V_SCALE, fp8_kv, needs_cuda, rel_err


@pytest.fixture
def transposed(monkeypatch: pytest.MonkeyPatch, count_launches) -> list[int]:
    monkeypatch.setattr(dec, "FP8_FORM", "transposed")
    return count_launches(dect)


def run(lens: list[int], hkv: int, g: int, d: int, qdtype: torch.dtype, gen: torch.Generator,
        device: torch.device, tol: float, **kw: object) -> None:
    kv, table = fp8_kv(lens, 16, hkv, d, gen, device)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(device=device, dtype=qdtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    out = dec.decode_attention(q, kv, table, seq, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
                               **kw)  # type: ignore[arg-type]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


@pytest.mark.parametrize("num_splits,fused", [(1, None), (3, True), (3, False)])
def test_transposed_matches_reference(num_splits, fused, transposed, gen, device):
    # contexts of one token, part of a tile, and several 64-token tiles per split
    run([1, 16, 130, 300], 2, 4, 32, torch.float32, gen, device, 1e-4,
        num_splits=num_splits, fused_merge=fused, max_seq_len=300)
    assert transposed == [1]


def test_transposed_sizes_its_own_splits_in_graph_mode(transposed, gen, device):
    """No max_seq_len (a CUDA graph's launch): each request sizes its splits on the device
    from the block table's capacity, and a short request leaves the later splits idle."""
    run([3, 200, 77], 1, 3, 32, torch.float32, gen, device, 1e-4)
    assert transposed == [1]


@pytest.mark.parametrize("fused", [True, False])
def test_transposed_merges_the_splits_a_request_sized_for_itself(fused, transposed, gen,
                                                                  device):
    """A 1,024-token table in 8 splits of at least 64 tokens: 520 tokens size their own at
    128 (65 rounded up to the 64-token tile), so 5 splits hold tokens, which the merge must
    count (not ceil(520 / 64) clipped to 8)."""
    lens = [520, 30, 1]
    kv, table = fp8_kv(lens, 16, 1, 32, gen, device)
    table = torch.cat([table, table.new_zeros(len(lens), 64 - table.shape[1])], dim=1)
    q = torch.randn(len(lens), 2, 32, generator=gen).to(device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = decode_attention_ref(q, kv, table, seq, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.full_like(q, float("nan"))
    dec.decode_attention(q, kv, table, seq, 0.2, out=out, k_scale=K_SCALE, v_scale=V_SCALE,
                         num_splits=8, fused_merge=fused)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)
    assert transposed == [1]


def test_group_past_sixteen_heads_runs_the_pointer_form(transposed, gen, device):
    run([20, 40], 1, 32, 16, torch.float32, gen, device, 1e-4, num_splits=1)
    assert transposed == []


def test_given_block_n_runs_the_pointer_form(transposed, gen, device):
    run([20, 40], 2, 2, 32, torch.float32, gen, device, 1e-4, block_n=16)
    assert transposed == []


def test_a_16_bit_cache_runs_the_pointer_form(transposed, gen, device):
    kv, table = fp8_kv([20], 16, 1, 32, gen, device)
    full = kv.float()
    q = torch.randn(1, 2, 32, generator=gen, device=device)
    seq = torch.tensor([20], dtype=torch.int32, device=device)
    out = dec.decode_attention(q, full, table, seq, 0.2)
    assert torch.allclose(out, decode_attention_ref(q, full, table, seq, 0.2), atol=1e-5)
    assert transposed == []


def test_unknown_form_is_refused_by_name(monkeypatch, gen, device):
    monkeypatch.setattr(dec, "FP8_FORM", "sideways")
    with pytest.raises(ValueError, match="FP8_FORM: 'sideways'"):
        run([20], 1, 2, 32, torch.float32, gen, device, 1e-4)


@pytest.mark.parametrize("batch,max_len", [(32, 4096), (4, 32768), (256, 1024)])
@pytest.mark.gpu
@needs_cuda
def test_transposed_gpu(batch, max_len, transposed, gen):
    """bf16 queries (fp16 products) at Llama-3-8B's 32/8 heads of 128."""
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    run(lens, 8, 4, 128, torch.bfloat16, gen, torch.device("cuda"), 1.2e-2)
    run(lens, 8, 4, 128, torch.bfloat16, gen, torch.device("cuda"), 1.2e-2,
        max_seq_len=max_len)
    assert transposed == [1, 1]
