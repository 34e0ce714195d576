"""A float8 KV pool (--kv-cache-dtype fp8) through the real transfer layer: a producer's
float8 blocks move into a consumer's float8 pool and its tokens equal a colocated float8
engine's (dense and MLA); the bytes moved are half a float16 pool's. Peers that disagree on
the KV dtype or on a layer's scale are refused at the handshake, naming both values."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from tiny_deepseek import make_tiny_deepseek
from tiny_models import PROMPTS, make_tiny_model
from xfer_helpers import cfg

from engine.kv_layout import KVLayout
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from transfer import HandshakeError, TransferStatus, make_receiver, make_sender
from transfer.types import TransferNotice

PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
FP8 = dict(block_size=4, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    return {"llama": make_tiny_model(str(root / "llama"), "llama"),
            "deepseek_v2": make_tiny_deepseek(str(root / "v2"), "v2", q_lora_rank=None)}


def _pd_tokens(p: LLM, c: LLM, backend: str, prompt: list[int],
               params: SamplingParams, rid: str) -> tuple[list[int], int]:
    """One request prefilled on p, its blocks pushed into c's reserved blocks, decoded on c;
    returns its tokens and the payload bytes the sender moved."""
    prod, cons = p.engine, c.engine
    with make_receiver(cons.kv_cache, cons.layout, cfg(backend)) as rx, \
            make_sender(prod.kv_cache, prod.layout, cfg(backend)) as tx:
        tx.connect(rx.address, timeout=10)
        prod.add_request(rid, prompt, params)
        outs: list = []
        while not outs:
            outs = list(prod.step().outputs)
        (t0,) = outs
        src = prod.requests[rid].block_ids
        dst = cons.reserve(len(prompt))
        assert dst is not None and len(dst) == len(src)
        rx.expect(rid, dst)
        tx.push(rid, rx.address, src, dst)
        tx.finish(rid, TransferNotice(rid, t0.new_token_ids[0], False, len(prompt),
                                      seed=t0.seed))
        assert rx.wait(rid, 20).status == TransferStatus.DONE
        assert tx.wait(rid, 20).status == TransferStatus.DONE
        tx.release(rid)
        rx.release(rid)
        prod.release(rid)
        moved = tx.stats().payload_bytes
    cons.add_prefilled(rid, prompt, params, dst, t0.new_token_ids[0])
    tokens = list(t0.new_token_ids)
    while cons.has_unfinished():
        for o in cons.step().outputs:
            tokens += o.new_token_ids
    return tokens, moved


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("backend", ["ipc", "fake"])
def test_fp8_pd_tokens_equal_colocated_fp8(models, arch, backend):
    path = models[arch]
    prompt = PROMPTS[2]  # 50 tokens: 13 blocks of 4, the last one partial
    with LLM(path, **FP8) as colo, \
            LLM(path, role="producer", max_num_batched_tokens=16, **FP8) as p, \
            LLM(path, role="consumer", **FP8) as c:
        assert p.engine.kv_cache.dtype == c.engine.kv_cache.dtype == torch.float8_e4m3fn
        for i, params in enumerate(PARAMS):
            want = colo.generate([prompt], params)[0].token_ids
            got, moved = _pd_tokens(p, c, backend, prompt, params, f"r{i}")
            assert got == want, (params, got, want)
            # one byte a value: 13 blocks of every layer's K/V (or latent) rows
            assert moved == 13 * p.engine.layout.block_nbytes
            lay = p.engine.layout
            per_value = lay.block_nbytes / (lay.rows_per_block * lay.head_count * lay.head_dim)
            assert per_value == 1


def _refused(p: LLM, c: LLM, match: str) -> None:
    with make_receiver(c.engine.kv_cache, c.engine.layout, cfg("ipc")) as rx, \
            make_sender(p.engine.kv_cache, p.engine.layout, cfg("ipc")) as tx, \
            pytest.raises(HandshakeError, match=match):
        tx.connect(rx.address, timeout=10)


def test_fp8_producer_and_float_consumer_are_refused(models):
    path = models["llama"]
    with LLM(path, role="producer", **FP8) as p, \
            LLM(path, role="consumer", block_size=4) as c:
        # the side that refuses names its own value first, then the peer's
        _refused(p, c, r"KV layout mismatch: dtype: 'float32' != 'float8_e4m3fn'; "
                       r"kv_scales: 0 scales != 4")
    with LLM(path, role="producer", block_size=4) as p, \
            LLM(path, role="consumer", **FP8) as c:
        _refused(p, c, r"KV layout mismatch: dtype: 'float8_e4m3fn' != 'float32'")


def test_fp8_peers_with_other_scales_are_refused(models, tmp_path):
    from safetensors.torch import save_file

    path = models["llama"]
    with LLM(path, role="producer", **FP8) as p, LLM(path, role="consumer", **FP8) as c:
        # the same model whose consumer pool was given other scales: only they differ
        other = dataclasses.replace(c.engine.layout, kv_scales=(1.0, 1.0, 1.0, 0.5))
        with make_receiver(c.engine.kv_cache, other, cfg("ipc")) as rx, \
                make_sender(p.engine.kv_cache, p.engine.layout, cfg("ipc")) as tx, \
                pytest.raises(HandshakeError, match=r"KV layout mismatch: kv_scales: layer 1 V "
                                                    r"scale 0.5 != 1.0 \(1 of 4 scales differ\)"):
            tx.connect(rx.address, timeout=10)
    # a checkpoint's scales are its files: its identity (model) differs too, and both show
    scaled = str(tmp_path / "scaled")
    shutil.copytree(path, scaled)
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(0.5),
               "model.layers.1.self_attn.k_scale": torch.tensor(1.0),
               "model.layers.0.self_attn.kv_scale": torch.tensor(1.0)},
              os.path.join(scaled, "kv_scales.safetensors"))
    with LLM(scaled, role="producer", **FP8) as p, LLM(path, role="consumer", **FP8) as c:
        assert p.engine.layout.kv_scales == (1.0, 1.0, 1.0, 0.5)
        _refused(p, c, r"model: .*; kv_scales: layer 1 V scale 1.0 != 0.5")


def test_layout_carries_dtype_and_scales():
    same = dict(model="m", block_size=16, num_layers=2, num_kv_heads=8, head_dim=128,
                num_blocks=4)
    bf16 = KVLayout(dtype="bfloat16", **same)
    fp8 = KVLayout(dtype="float8_e4m3fn", kv_scales=[1, 1.0, 0.5, 1.0], **same)
    assert fp8.kv_scales == (1.0, 1.0, 0.5, 1.0)  # a peer's list, as floats
    assert fp8.block_nbytes * 2 == bf16.block_nbytes
    assert len({bf16.fingerprint(), fp8.fingerprint(),
                KVLayout(dtype="float8_e4m3fn", kv_scales=(1.0,) * 4, **same).fingerprint()}) == 3
    assert fp8.describe_mismatch(bf16) == ("dtype: 'float8_e4m3fn' != 'bfloat16'; "
                                           "kv_scales: 4 scales != 0")
    with pytest.raises(ValueError, match=r"^kv_scales: a float8_e4m3fn pool needs a K and a V "
                                         r"scale per layer \(4\), got 2"):
        KVLayout(dtype="float8_e4m3fn", kv_scales=(1.0, 1.0), **same)
    with pytest.raises(ValueError, match="^kv_scales: each must be finite and > 0, got nan"):
        KVLayout(dtype="float8_e4m3fn", kv_scales=(1.0, float("nan"), 1.0, 1.0), **same)
    with pytest.raises(ValueError, match="^kv_scales: a bfloat16 pool has no scales, got 4"):
        KVLayout(dtype="bfloat16", kv_scales=(1.0,) * 4, **same)
    with pytest.raises(ValueError, match="^kv_scales: expected a list of numbers"):
        KVLayout(dtype="float8_e4m3fn", kv_scales=("1.0",) * 4, **same)
