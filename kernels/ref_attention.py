"""Plain-torch references for attention over the paged, block-major KV cache.

Both functions read every key/value from the cache, so ``store_kv`` for the step's new
tokens runs first. Softmax runs in float32 whatever the cache dtype; a float8 cache's
entries are multiplied by their layer's K or V scale first (kernels/kv_fp8.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_fp8 import from_cache, take


def _gather_kv(
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    blocks: torch.Tensor,  # [nb] block ids of one request
    seq_len: int,
    k_scale: float,
    v_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Hkv, D] float32 each
    kv = take(kv_layer, (blocks,))  # [nb, 2, BS, Hkv, D]
    k = kv[:, 0].reshape(-1, *kv.shape[-2:])[:seq_len]  # [S, Hkv, D]
    v = kv[:, 1].reshape(-1, *kv.shape[-2:])[:seq_len]
    return from_cache(k, k_scale), from_cache(v, v_scale)


def prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]: the queries of every request's current chunk, packed
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: request b's queries are q[cu[b]:cu[b+1]]
    seq_lens: torch.Tensor,  # [B] int32: context length after this chunk (cached + chunk)
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    *,
    max_seq_len: int | None = None,  # the Triton launcher's split-K hint; unused here
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
    # A CUDA graph's launch (the Triton launcher's splits then come from the table alone):
    # tokens after cu[B] are padding rows, written as zeros.
    fixed_grid: bool = False,
) -> torch.Tensor:
    """Query j of a chunk of length n sits at position seq_len - n + j and attends causally."""
    if out is None:
        out = torch.empty_like(q)
    block_size = kv_layer.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if fixed_grid:
        out[cu[-1]:] = 0
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        n = end - start
        if n == 0:
            continue
        nb = -(-seq_len // block_size)
        k, v = _gather_kv(kv_layer, block_tables[b, :nb].long(), seq_len, k_scale, v_scale)
        # 4-D with a batch of one: the form torch's fused CPU attention kernel accepts.
        qb = q[start:end].transpose(0, 1).float()[None]  # [1, Hq, n, D]
        kb = k.transpose(0, 1).float()[None]  # [1, Hkv, S, D]
        vb = v.transpose(0, 1).float()[None]
        if n == seq_len:  # nothing cached before the chunk: plain causal, no mask to build
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:  # causal with the chunk's queries placed at the end of the context
            qpos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]  # [n, S]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]: one query per request
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including this token
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    *,
    max_seq_len: int | None = None,  # the Triton launcher's split-K hint; unused here
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Batched: pads every request's context to the longest and masks the tail."""
    if out is None:
        out = torch.empty_like(q)
    bsz = q.shape[0]
    if bsz == 0:
        return out
    block_size = kv_layer.shape[2]
    max_len = int(seq_lens.max())
    nb = -(-max_len // block_size)
    blocks = block_tables[:, :nb].long()  # [B, nb]
    kv = take(kv_layer, (blocks.reshape(-1),))  # [B*nb, 2, BS, Hkv, D]
    kv = kv.reshape(bsz, nb, 2, block_size, *kv.shape[-2:])
    k = kv[:, :, 0].reshape(bsz, nb * block_size, *kv.shape[-2:])  # [B, S, Hkv, D]
    v = kv[:, :, 1].reshape(bsz, nb * block_size, *kv.shape[-2:])
    valid = torch.arange(nb * block_size, device=q.device)[None, :] < seq_lens[:, None].long()
    o = F.scaled_dot_product_attention(
        q.float().unsqueeze(2),  # [B, Hq, 1, D]
        from_cache(k.transpose(1, 2), k_scale),  # [B, Hkv, S, D]
        from_cache(v.transpose(1, 2), v_scale),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out.copy_(o.squeeze(2).to(out.dtype))
    return out
