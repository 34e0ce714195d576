"""Sharded weight loading: a tensor-parallel rank reads only its slices, and they are
exactly the full tensors' slices (safetensors through get_slice; GGUF rows cut before
dequantizing, q/k un-permuted per head)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from engine.config import ModelConfig
from engine.gguf_reader import iter_gguf_tensors, read_gguf_config
from engine.model_source import resolve_model
from engine.parallel.shards import hf_slice, shard_for
from engine.weights import _safetensors


def _narrow(t: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    return t if cut is None else t.narrow(cut[0], cut[1], cut[2] - cut[1])


def test_safetensors_slices_equal_the_full_tensors_slices(tmp_path):
    path = make_tiny_model(str(tmp_path / "q"), "qwen2", num_key_value_heads=2,
                           vocab_size=254)  # qkv bias; a short last vocabulary shard
    cfg = ModelConfig.from_dir(path)
    full = dict(_safetensors(path, lambda n: None))
    for rank in range(4):
        shard = shard_for(cfg, rank, 4)

        def slicer(n: str, shard=shard) -> tuple[int, int, int] | None:
            return hf_slice(shard, n, cfg.head_dim)

        part = dict(_safetensors(path, slicer))
        assert part.keys() == full.keys()
        cut_any = False
        for name, t in part.items():
            cut = slicer(name)
            cut_any |= cut is not None
            assert torch.equal(t, _narrow(full[name], cut)), (rank, name)
        assert cut_any
        q = part["model.layers.0.self_attn.q_proj.weight"]
        assert q.shape[0] == cfg.head_dim  # one of 4 query heads
        k_bias = part["model.layers.0.self_attn.k_proj.bias"]
        # 2 KV heads over 4 ranks: ranks 0, 1 read head 0; ranks 2, 3 head 1
        assert torch.equal(k_bias, full["model.layers.0.self_attn.k_proj.bias"][
            (rank // 2) * cfg.head_dim:(rank // 2 + 1) * cfg.head_dim])
        rows = part["model.embed_tokens.weight"].shape[0]
        assert rows == (64 if rank < 3 else 254 - 3 * 64)


@pytest.mark.parametrize("rank", [1])
def test_gguf_slices_equal_the_full_tensors_slices(rank):
    path = resolve_model(None)  # SmolLM2-135M Q4_1: 9 heads, 3 KV heads, tied embeddings
    cfg = ModelConfig.from_hf(read_gguf_config(path))
    shard = shard_for(cfg, rank, 3)

    def slicer(n: str) -> tuple[int, int, int] | None:
        return hf_slice(shard, n, cfg.head_dim)

    seen = 0
    full = iter_gguf_tensors(path)
    for (name, t), (fname, ft) in zip(iter_gguf_tensors(path, slicer), full, strict=True):
        assert name == fname
        if ".layers.2." in name or ".layers." not in name:  # one layer is enough
            assert torch.equal(t, _narrow(ft, slicer(name))), name
            seen += 1
    assert seen >= 10
