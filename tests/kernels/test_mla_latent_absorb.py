"""The latent kernel and the W_UK product in one launch (kernels/triton_mla_latent_absorb.py)
write, bit for bit, what their two launchers write one after the other, and nothing else;
and the engine with engine.models.mla.FUSED_LATENT_ABSORB on decodes the same logits with a
kernel less per layer."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import FP8_DTYPE

NAN_BYTE = 0x7F  # float8_e4m3fn's NaN: a float8 cache filled with it reads as untouched


def _nan_like(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype == FP8_DTYPE:
        return torch.full(shape, NAN_BYTE, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so that equal NaNs compare equal (an untouched entry stays the same NaN)."""
    return t.contiguous().view(torch.uint8)


def _inputs(t: int, h: int, dn: int, r: int, c: int, dv: int, dtype: torch.dtype,
            kv_dtype: torch.dtype, gen: torch.Generator, device: torch.device):
    """A decode step's tensors as engine/models/mla.py hands them over: q and kv_a column
    views of one projection output, q_nope q's first Dn columns, W_UK a view of kv_b_proj's
    weight, and the absorbed query (its two column ranges the outputs) inside a wider
    buffer whose extra columns nobody may write."""
    bs, nb = 4, 2 * t + 2
    n = h * (dn + r)
    both = torch.randn(t, n + c + r, generator=gen).to(dtype)  # [T, Nq + C + R]
    w = torch.randn(h * (dn + dv), c, generator=gen).to(dtype) * 0.1  # kv_b_proj's weight
    norm_w = (torch.rand(c, generator=gen) + 0.5).to(dtype)
    pos = torch.randint(0, 60, (t,), generator=gen)
    cs = torch.randn(64, r, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    if t > 1:
        slots[0] = -1  # a padding row: rotated and multiplied, nothing stored
    both, w, norm_w, pos, cs, slots = (x.to(device) for x in (both, w, norm_w, pos, cs, slots))
    q = both[:, :n].view(t, h, dn + r)
    return dict(kv_a=both[:, n:], q=q, norm_weight=norm_w, eps=1e-6, positions=pos,
                cos_sin=cs, slot_mapping=slots, q_nope=q[..., :dn],
                w_uk=w.view(h, dn + dv, c)[:, :dn],
                kv_layer=_nan_like((nb, 1, bs, 1, c + r), kv_dtype, device),
                buf=_nan_like((t, h, c + r + 8), dtype, device))


def _run(fused: bool, a: dict, c: int, scale: float, in_place: bool) -> tuple[torch.Tensor, ...]:
    """The step on copies of the outputs (and of q, which the in-place form writes):
    (the absorbed query's buffer, the cache, q)."""
    from kernels.triton_mla_absorb import mla_absorb_q
    from kernels.triton_mla_latent import mla_latent_store
    from kernels.triton_mla_latent_absorb import mla_latent_absorb

    buf, kv, q = a["buf"].clone(), a["kv_layer"].clone(), a["q"].clone()
    q_nope = q[..., :a["q_nope"].shape[-1]]
    out, q_pe_out = buf[..., :c], None if in_place else buf[..., c:buf.shape[-1] - 8]
    latent = (a["kv_a"], q, a["norm_weight"], a["eps"], a["positions"], a["cos_sin"], kv,
              a["slot_mapping"])
    if fused:
        mla_latent_absorb(*latent, q_nope, a["w_uk"], out, scale=scale, q_pe_out=q_pe_out)
    else:
        mla_latent_store(*latent, scale=scale, q_pe_out=q_pe_out)
        mla_absorb_q(q_nope, a["w_uk"], out)
    return buf, kv, q


# the launchers' tiles, and smaller ones that split the product into several column blocks
# (the last one partial) and, past 2 rows, several row groups
TILES = {"default": None, "split": dict(BLOCK_C=16, ROWS=2)}


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("kv", ["float", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_one_launch_writes_what_the_two_write(t, dtype, kv, tiles, gen, device, monkeypatch):
    import kernels.triton_mla_absorb as ab

    for name, value in (TILES[tiles] or {}).items():
        monkeypatch.setattr(ab, name, value)
    # widths under their powers of two (masked): heads 3, nope 24, latent 40; rope 16
    h, dn, r, c, dv = 3, 24, 16, 40, 20
    a = _inputs(t, h, dn, r, c, dv, dtype, FP8_DTYPE if kv == "fp8" else dtype, gen, device)
    scale = 0.25 if kv == "fp8" else 1.0
    q0 = a["q"].clone()
    buf, cache, q = _run(True, a, c, scale, in_place=False)
    want_buf, want_cache, _ = _run(False, a, c, scale, in_place=False)
    assert torch.equal(_bits(buf), _bits(want_buf))
    assert torch.equal(_bits(cache), _bits(want_cache))
    assert torch.equal(q, q0)  # the rotated q_pe went to the absorbed query only
    # both column ranges written, the columns past them not
    assert not buf[..., :c + r].float().isnan().any()
    assert buf[..., c + r:].float().isnan().all()
    # the cache: exactly the real tokens' rows (a float8 row may hold a saturated value,
    # never a NaN)
    rows = cache.view(-1, c + r).float()
    slots = a["slot_mapping"]
    stored = torch.zeros(rows.shape[0], dtype=torch.bool, device=device)
    stored[slots[slots >= 0]] = True
    assert not rows[stored].isnan().any() and rows[~stored].isnan().all()


def test_queries_rotated_in_place_without_a_destination(gen, device):
    """q_pe_out None: as mla_latent_store, q's own rope columns are rotated."""
    a = _inputs(3, 2, 8, 16, 32, 8, torch.float32, torch.float32, gen, device)
    buf, cache, q = _run(True, a, 32, 1.0, in_place=True)
    want_buf, want_cache, want_q = _run(False, a, 32, 1.0, in_place=True)
    assert torch.equal(q, want_q) and not torch.equal(q, a["q"])
    assert torch.equal(_bits(buf), _bits(want_buf)) and torch.equal(_bits(cache),
                                                                    _bits(want_cache))


def test_no_tokens_launches_nothing(gen, device):
    from kernels.triton_mla_latent_absorb import mla_latent_absorb

    a = _inputs(1, 2, 8, 16, 32, 8, torch.float32, torch.float32, gen, device)
    e = {k: v[:0] if k in ("kv_a", "q", "positions", "slot_mapping", "q_nope", "buf") else v
         for k, v in a.items()}
    kv = e["kv_layer"]
    mla_latent_absorb(e["kv_a"], e["q"], e["norm_weight"], 1e-6, e["positions"], e["cos_sin"],
                      kv, e["slot_mapping"], e["q_nope"], e["w_uk"], e["buf"][..., :32])
    assert kv.isnan().all()


def test_bad_arguments_name_the_argument(gen, device):
    from kernels.triton_mla_latent_absorb import mla_latent_absorb

    a = _inputs(2, 2, 8, 16, 32, 8, torch.float32, torch.float32, gen, device)
    latent = [a[k] for k in ("kv_a", "q", "norm_weight", "eps", "positions", "cos_sin",
                             "kv_layer", "slot_mapping")]
    q_nope, w_uk, out = a["q_nope"], a["w_uk"], a["buf"][..., :32]
    with pytest.raises(ValueError, match="norm_weight"):  # the latent launcher's checks
        mla_latent_absorb(*latent[:2], a["norm_weight"][:31], *latent[3:], q_nope, w_uk, out)
    with pytest.raises(ValueError, match="out: expected"):  # the absorb launcher's
        mla_latent_absorb(*latent, q_nope, w_uk, a["buf"][..., :16])
    with pytest.raises(ValueError, match="q_nope"):  # one step: the same tokens and heads
        mla_latent_absorb(*latent, q_nope[:1], w_uk, out[:1])
    with pytest.raises(ValueError, match="w_uk"):  # and the latent's width
        mla_latent_absorb(*latent, q_nope, w_uk[..., :16], a["buf"][..., :16])


# --- the engine: engine.models.mla.FUSED_LATENT_ABSORB on and off ---------------------------

# a small DeepSeek-V2 (V2-Lite's layout, bench/decode_op_count.SMALL), all layers dense:
# the switch is MLA's, and the MoE layers add nothing to it
DENSE = dict(first_k_dense_replace=3)


def _greedy_decode(config: str, batch: int, steps: int, kv_dtype: torch.dtype,
                   seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """steps greedy decode steps of `batch` requests over a random 9-token context, with the
    engine's CUDA kernel set run by the interpreter: (each step's logits, the cache)."""
    from engine.attention import AttentionMetadata, kernels_for
    from engine.weights import build_model, read_model_config

    cfg = read_model_config(config)
    cpu = torch.device("cpu")
    model = build_model(config, cfg, kernels_for(torch.device("cuda")), cpu, "float32",
                        "dummy", 64)
    if kv_dtype == FP8_DTYPE:  # a float8 cache's latent scale, one per layer
        for layer in model.layers:
            layer.self_attn.kv_scale = 0.05
    gen = torch.Generator().manual_seed(seed)
    bs, context = 4, 9
    per_req = -(-(context + steps) // bs)
    kv = (torch.randn(batch * per_req + 1, cfg.num_layers, 1, bs, 1,
                      cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen) * 0.1).to(kv_dtype)
    tables = torch.arange(1, batch * per_req + 1, dtype=torch.int32).view(batch, per_req)
    ids = torch.randint(3, cfg.vocab_size, (batch,), generator=gen)
    logits = []
    for step in range(steps):
        p = context + step  # the new token's position
        pos = torch.full((batch,), p, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=tables[:, p // bs].long() * bs + p % bs, block_tables=tables,
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), p + 1, dtype=torch.int32), decode_only=True,
            max_seq_len=None)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, pos, kv, meta)))
        ids = logits[-1].argmax(-1)
    return logits, kv


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; -m gpu covers it")
@pytest.mark.parametrize("kv", ["float", "fp8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_engine_decodes_the_same_with_the_switch_on(batch, kv, tmp_path, monkeypatch):
    import engine.models.mla as mla
    from bench.decode_op_count import write_config

    config = write_config(str(tmp_path / "config.json"), "v2", **DENSE)
    kv_dtype = FP8_DTYPE if kv == "fp8" else torch.float32
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(mla, "FUSED_LATENT_ABSORB", on)
        runs[on] = _greedy_decode(config, batch, 3, kv_dtype)
    (off_logits, off_kv), (on_logits, on_kv) = runs[False], runs[True]
    for a, b in zip(off_logits, on_logits, strict=True):
        assert torch.equal(a, b)  # the same kernels' bodies: the same bits
    assert torch.equal(_bits(off_kv), _bits(on_kv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
@pytest.mark.parametrize("batch", [1, 4, 5])
def test_engine_launches_a_kernel_less_per_layer(batch, tmp_path, monkeypatch):
    """Up to ABSORB_KERNEL_MAX_ROWS rows one launch replaces the latent and absorb kernels;
    past it (torch.bmm for the product) the latent kernel runs alone, as with the switch off."""
    import engine.models.mla as mla
    from bench.decode_op_count import count_decode_step, write_config

    config = write_config(str(tmp_path / "config.json"), "v2", **DENSE)
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(mla, "FUSED_LATENT_ABSORB", on)
        counts[on] = count_decode_step(config, batch=batch)
    layers = [k for k in counts[True] if k.startswith("layer.")]
    assert len(layers) == 3
    fused = batch <= mla.ABSORB_KERNEL_MAX_ROWS
    for layer in layers:
        off, on = counts[False][layer], counts[True][layer]
        assert on.total == off.total - fused, (layer, off, on)
        assert on.triton["_latent_absorb_kernel"] == fused
        assert on.triton["_mla_latent_kernel"] == (not fused)
        assert on.triton["_absorb_kernel"] == 0 and off.triton["_absorb_kernel"] == fused
        assert on.triton["_up_kernel"] == off.triton["_up_kernel"] == fused
