"""MLA decode's split merge inside the W_UV product (kernels/triton_mla_up_merge.py)
against the two launches it replaces: the merge kernel into o_lat, then mla_up_v."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import paged_latent


def _inputs(lens, heads, c, r, dv, dtype, gen, device):  # type: ignore[no-untyped-def]
    kv, table = paged_latent(lens, 16, c + r, dtype, gen, device)
    q = torch.randn(len(lens), heads, c + r, generator=gen).to(dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    # W_UV as engine/models/mla.py hands it: a view of kv_b_proj's [H, Dn + Dv, C] weight
    w = torch.randn(heads, 24 + dv, c, generator=gen).to(dtype=dtype, device=device) * 0.1
    return q, kv, table, seq_lens, w[:, 24:]


def _both(q, kv, table, seq_lens, w_uv, c, **kw):  # type: ignore[no-untyped-def]
    from kernels.triton_mla_absorb import mla_up_v
    from kernels.triton_mla_decode import mla_decode, mla_decode_unmerged
    from kernels.triton_mla_up_merge import mla_up_v_merged

    b, h, dv = q.shape[0], q.shape[1], w_uv.shape[1]
    want = torch.full((b, h, dv), float("nan"), dtype=q.dtype, device=q.device)
    mla_up_v(mla_decode(q, kv, table, seq_lens, 0.2, c, block_n=16, **kw), w_uv, want)
    d = mla_decode_unmerged(q, kv, table, seq_lens, 0.2, c, block_n=16, **kw)
    got = torch.full_like(want, float("nan"))
    assert mla_up_v_merged(d, seq_lens, w_uv, got) is got
    return d, want, got


def _same(got, want, close):  # type: ignore[no-untyped-def]
    if got.is_cuda:  # compiled apart, the two kernels may contract multiply-adds apart
        close(got, want, got.dtype)
    else:  # the interpreter: one arithmetic, one result
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[300], [70, 5, 129], [40, 0, 33, 17, 90]])
def test_equals_merge_then_product(dtype, lens, gen, device, close):
    # host lengths (max_seq_len) and graph mode (each request splits its own context;
    # a length-0 row, a graph's padding, gets zeros); five rows: two row groups of ROWS
    q, kv, table, seq_lens, w_uv = _inputs(lens, 4, 32, 16, 20, dtype, gen, device)
    for kw in ({"num_splits": 3, "max_seq_len": max(lens)}, {}):
        d, want, got = _both(q, kv, table, seq_lens, w_uv, 32, **kw)
        assert d.part_o is not None, "the case must split, or it tests only the fallback"
        _same(got, want, close)
        assert not torch.isnan(got).any()
    if 0 in lens:
        assert torch.equal(got[lens.index(0)], torch.zeros_like(got[0]))


def test_widths_under_their_powers_of_two(gen, device, close):
    # C = 24 (partials padded to 32), Dv = 20 (a partial BLOCK_D column block)
    q, kv, table, seq_lens, w_uv = _inputs([50, 21], 3, 24, 8, 20, torch.float32, gen, device)
    d, want, got = _both(q, kv, table, seq_lens, w_uv, 24, num_splits=2, max_seq_len=50)
    assert d.part_o is not None
    _same(got, want, close)


def test_one_split_falls_back_to_the_plain_product(gen, device, close):
    q, kv, table, seq_lens, w_uv = _inputs([9], 2, 32, 16, 20, torch.float32, gen, device)
    d, want, got = _both(q, kv, table, seq_lens, w_uv, 32, num_splits=1, max_seq_len=9)
    assert d.part_o is None
    _same(got, want, close)


def test_one_launch_fewer(gen, device, monkeypatch):
    # decode + merge + product against decode + merged product: counted at the launches
    import kernels.triton_mla_absorb as ab
    import kernels.triton_mla_decode as dec
    import kernels.triton_mla_up_merge as um

    launched: list[str] = []

    class Counting:
        def __init__(self, name, kernel):  # type: ignore[no-untyped-def]
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launched.append(self.name)
            return self.kernel[grid]

    for mod, name in ((dec, "_mla_decode_kernel"), (dec, "_mla_merge_kernel"),
                      (ab, "_up_kernel"), (um, "_up_merge_kernel")):
        monkeypatch.setattr(mod, name, Counting(name, getattr(mod, name)))
    q, kv, table, seq_lens, w_uv = _inputs([200], 2, 32, 16, 20, torch.float32, gen, device)
    _both(q, kv, table, seq_lens, w_uv, 32, num_splits=4, max_seq_len=200)
    assert launched == ["_mla_decode_kernel", "_mla_merge_kernel", "_up_kernel",
                        "_mla_decode_kernel", "_up_merge_kernel"]


def test_bad_arguments_name_the_argument(gen, device):
    from kernels.triton_mla_decode import mla_decode_unmerged
    from kernels.triton_mla_up_merge import mla_up_v_merged

    q, kv, table, seq_lens, w_uv = _inputs([64], 2, 32, 16, 20, torch.float32, gen, device)
    d = mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, num_splits=2, max_seq_len=64)
    with pytest.raises(ValueError, match="w_uv"):
        mla_up_v_merged(d, seq_lens, w_uv[:, :, :16], torch.empty(1, 2, 20, device=device))
    with pytest.raises(ValueError, match="out"):
        mla_up_v_merged(d, seq_lens, w_uv, torch.empty(1, 2, 19, device=device))


# --- the engine: engine.models.mla.FUSED_UP_MERGE on and off ------------------------------

# a small DeepSeek-V2 (bench/decode_op_count.SMALL), all layers dense: the switch is MLA's
DENSE = dict(first_k_dense_replace=3)
# a context the interpreter's decode splits at batch 1 (a graph's split count, sized for
# the table's capacity; each split at least FEW_PROGRAMS_MIN_SPLIT_TOKENS = 64 tokens)
CONTEXT = 200


def _decode_logits(config: str, batch: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """One decode step's logits of `batch` requests over a random CONTEXT-token cache, the
    engine's CUDA kernel set run by the interpreter, as a CUDA graph runs it (no host
    lengths)."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(config)
    model = build_model(config, cfg, kernels_for(torch.device("cuda")), torch.device("cpu"),
                        "float32", "dummy", CONTEXT)
    if kv_dtype != torch.float32:  # a float8 cache's latent scale, one per layer
        for layer in model.layers:
            layer.self_attn.kv_scale = 0.05
    gen = torch.Generator().manual_seed(0)
    bs = 16
    per_req = -(-CONTEXT // bs)
    kv = (torch.randn(batch * per_req + 1, cfg.num_layers, 1, bs, 1,
                      cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen) * 0.1).to(kv_dtype)
    tables = torch.arange(1, batch * per_req + 1, dtype=torch.int32).view(batch, per_req)
    p = CONTEXT - 1  # the new token's position
    meta = AttentionMetadata(
        slot_mapping=tables[:, p // bs].long() * bs + p % bs, block_tables=tables,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), CONTEXT, dtype=torch.int32), decode_only=True,
        max_seq_len=None)
    ids = torch.randint(3, cfg.vocab_size, (batch,), generator=gen)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.full((batch,), p), kv, meta))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; -m gpu covers it")
@pytest.mark.parametrize("kv", ["float", "fp8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_decodes_the_same_with_the_switch_on(batch, kv, tmp_path, monkeypatch):
    import engine.models.mla as mla
    from bench.decode_op_count import write_config
    from kernels.kv_fp8 import FP8_DTYPE

    config = write_config(str(tmp_path / "config.json"), "v2", **DENSE)
    kv_dtype = FP8_DTYPE if kv == "fp8" else torch.float32
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(mla, "FUSED_UP_MERGE", on)
        runs[on] = _decode_logits(config, batch, kv_dtype)
    assert torch.equal(runs[False], runs[True])  # the same arithmetic: the same bits


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
@pytest.mark.parametrize("batch", [1, 5])
def test_engine_launches_a_kernel_less_per_layer(batch, tmp_path, monkeypatch):
    """At few rows the merge goes into the W_UV product; past ABSORB_KERNEL_MAX_ROWS
    (torch.bmm for the product) decode and merge run as with the switch off."""
    import engine.models.mla as mla
    from bench.decode_op_count import count_decode_step, write_config

    config = write_config(str(tmp_path / "config.json"), "v2", **DENSE)
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(mla, "FUSED_UP_MERGE", on)
        counts[on] = count_decode_step(config, batch=batch, context=CONTEXT, block_size=16)
    layers = [k for k in counts[True] if k.startswith("layer.")]
    assert len(layers) == 3
    fused = batch <= mla.ABSORB_KERNEL_MAX_ROWS
    for layer in layers:
        off, on = counts[False][layer], counts[True][layer]
        assert off.triton["_mla_merge_kernel"] == 1, "the context must split"
        assert on.total == off.total - fused, (layer, off, on)
        assert on.triton["_up_merge_kernel"] == fused
        assert on.triton["_mla_merge_kernel"] == (not fused)
        assert on.triton["_up_kernel"] == 0  # fused, or torch.bmm past the rows bound


def test_tma_form_partials_merge_in_the_product(count_launches, gen, device, close):
    # the engine's path (decode, then the W_UV product merging the splits) over the TMA
    # form's partials, graph mode included: its tile (a page's) sizes each request's splits,
    # and the merge must size them alike
    import kernels.triton_mla_decode_tma as mod
    from kernels.ref_mla_decode import mla_decode_ref
    from kernels.triton_mla_absorb import mla_up_v
    from kernels.triton_mla_decode import mla_decode_unmerged
    from kernels.triton_mla_up_merge import mla_up_v_merged
    calls = count_launches(mod)
    lens = [300, 0, 70, 129]
    q, kv, table, seq_lens, w_uv = _inputs(lens, 4, 32, 16, 20, torch.float32, gen, device)
    want = torch.empty(len(lens), 4, 20, device=device)
    mla_up_v(mla_decode_ref(q, kv, table, seq_lens, 0.2, 32), w_uv, want)
    for i, kw in enumerate(({"num_splits": 3, "max_seq_len": max(lens)}, {})):
        d = mla_decode_unmerged(q, kv, table, seq_lens, 0.2, 32, form="tma", **kw)
        assert d.part_o is not None and len(calls) == i + 1  # split, by the form asked for
        got = torch.full_like(want, float("nan"))
        mla_up_v_merged(d, seq_lens, w_uv, got)
        close(got, want, torch.float32)
