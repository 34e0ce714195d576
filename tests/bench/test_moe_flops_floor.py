"""bench/moe_bench.prefill_flops counts the matmul FLOPs a prefill runs (torch's own FLOP
counter over a real prefill forward on CPU decides), shared experts included wherever the
block folded them into its stacked experts; bench/moe_floor reads a tied head whole."""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import decode_op_count  # noqa: E402
from moe_bench import prefill_flops  # noqa: E402
from moe_floor import dense_weight_bytes, moe_blocks  # noqa: E402

from engine.attention import AttentionMetadata, kernels_for  # noqa: E402
from engine.weights import build_model, read_model_config  # noqa: E402

TOKENS = 48
BLOCK = 16


def _mla_zero(q_nope, q_pe, kv, k_pe, starts, cu, seq_lens, scale, out=None):
    o = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], kv.shape[2] - q_nope.shape[2])
    return o if out is None else out.copy_(o)


def _gqa_zero(q, kv_layer, block_tables, cu, seq_lens, scale, out=None, **kw):
    return torch.zeros_like(q) if out is None else out.zero_()


def _model(tmp_path, version, **overrides):
    path = decode_op_count.write_config(str(tmp_path / "config.json"), version, **overrides)
    cfg = read_model_config(path)
    # the attention core gives zeros and no FLOPs: the counter sees the matmuls alone, and
    # the causal attention term is checked apart (below)
    kernels = dataclasses.replace(kernels_for(torch.device("cpu")), mla_prefill=_mla_zero,
                                  prefill_attention=_gqa_zero)
    return cfg, build_model(path, cfg, kernels, torch.device("cpu"), "float32", "dummy", 64)


def _counted_matmul_flops(cfg, model):
    nb = -(-TOKENS // BLOCK)
    kv = torch.zeros(nb + 1, *decode_op_count._block_shape(cfg, BLOCK))
    pos = torch.arange(TOKENS)
    meta = AttentionMetadata(
        slot_mapping=pos + BLOCK, block_tables=torch.arange(1, nb + 1, dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, TOKENS], dtype=torch.int32),
        seq_lens=torch.tensor([TOKENS], dtype=torch.int32), decode_only=False,
        max_seq_len=TOKENS, cu_seqlens_q_host=[0, TOKENS], seq_lens_host=[TOKENS])
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        hidden = model(torch.randint(3, cfg.vocab_size, (TOKENS,)), pos, kv, meta)
        model.compute_logits(hidden[-1:])  # the head for the last row, as a prefill runs it
    return counter.get_total_flops()


def _attention_flops(cfg):
    dims = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim if cfg.is_mla
            else 2 * cfg.head_dim)
    return cfg.num_layers * cfg.num_heads * dims * TOKENS * TOKENS


@pytest.mark.parametrize("version", ["v2", "v3", "qwen3"])
def test_prefill_flops_are_what_the_prefill_multiplies(tmp_path, version):
    cfg, model = _model(tmp_path, version)
    if version != "qwen3":  # DeepSeek's shared experts, folded into the stacked experts
        assert moe_blocks(model)[0].folded_shared > 0
    engine = types.SimpleNamespace(model_cfg=cfg, runner=types.SimpleNamespace(model=model))
    code = prefill_flops(engine, TOKENS) - _attention_flops(cfg)
    counted = _counted_matmul_flops(cfg, model)
    # the code also counts the norms' weights as products (2 x tokens x a few hundred
    # values): well under 1% here; the shared experts it once left out were a third of v2's
    assert code == pytest.approx(counted, rel=0.01)


def test_a_tied_head_is_read_whole(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "u").mkdir()
    _, tied = _model(tmp_path / "t", "qwen3", tie_word_embeddings=True)
    _, untied = _model(tmp_path / "u", "qwen3", tie_word_embeddings=False)
    # the same weights but one: an untied model's separate embedding, which a step does not read
    assert dense_weight_bytes(tied) == dense_weight_bytes(untied)
    head = untied.lm_head.weight
    assert dense_weight_bytes(tied) > head.numel() * head.element_size()
