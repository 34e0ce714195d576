"""Logits of a whole sequence from an engine's model and KV pool, in one prefill: what the
float8 KV tests compare position by position (teacher forcing), on CPU or GPU."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.llm import LLM


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """[n, vocab] float32: the logits at every prompt position from one prefill through the
    engine's model and KV pool (each position attends over K/V read back from the pool), in
    blocks the engine's block manager lends and takes back (no cached prefix is touched)."""
    eng = llm.engine
    bs = eng.config.block_size
    n = len(prompt)
    blocks = eng.reserve(n)
    assert blocks is not None, "the pool cannot hold the sequence"
    dev = eng.device
    table = torch.tensor(blocks, dtype=torch.int64, device=dev)
    pos = torch.arange(n, device=dev)
    meta = AttentionMetadata(
        slot_mapping=table[pos // bs] * bs + pos % bs,
        block_tables=table.to(torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev), decode_only=False,
        cu_seqlens_q_host=[0, n], seq_lens_host=[n])
    model = eng.runner.model
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt, device=dev), torch.arange(n, device=dev),
                       eng.kv_cache, meta)
        out = model.compute_logits(hidden).float()
    eng.unreserve(blocks)
    return out
