"""Plain-torch reference of MLA decode in the absorbed form, over the paged latent cache.

DeepSeek's MLA caches, per token and layer, one latent row ``[kv_lora_rank + rope]``: the
normed compressed KV (``c``, kv_lora_rank values) then the roped key shared by every head
(``k_pe``). In the absorbed form each query head has already been mapped onto the latent
(q_nope through W_UK), so attention is multi-query over one "head" of width C + R whose
value is the latent's first C values; the caller maps the result back through W_UV.

Softmax runs in float32 whatever the cache dtype; a float8 cache's rows are multiplied by
their layer's scale first (kernels/kv_fp8.py).
"""

from __future__ import annotations

import torch

from kernels.kv_fp8 import from_cache, take


def mla_decode_ref(
    q: torch.Tensor,  # [B, H, C + R]: [q_nope @ W_UK | roped q_pe] per head
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, C + R]: the latent cache of one layer
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including this token (0: none)
    scale: float,
    kv_lora_rank: int,  # C: the value is the latent's first C values
    out: torch.Tensor | None = None,  # [B, H, C]
    *,
    max_seq_len: int | None = None,  # the Triton launcher's split-K hint; unused here
    kv_scale: float = 1.0,  # float8 cache: this layer's latent scale
) -> torch.Tensor:  # [B, H, C]
    """Batched: pads every request's context to the longest and masks the tail; a request
    with no context (a graph's padding row) gets zeros."""
    bsz, heads, _ = q.shape
    c = kv_lora_rank
    if out is None:
        out = q.new_empty(bsz, heads, c)
    if bsz == 0:
        return out
    bs = kv_layer.shape[2]
    max_len = max(int(seq_lens.max()), 1)
    nb = -(-max_len // bs)
    blocks = block_tables[:, :nb].long()  # [B, nb]
    lat = take(kv_layer, (blocks.reshape(-1), 0, slice(None), 0))  # [B*nb, BS, C+R]
    lat = from_cache(lat.reshape(bsz, nb * bs, -1), kv_scale)  # [B, S, C+R] float32
    scores = torch.einsum("bhd,bsd->bhs", q.float(), lat) * scale  # [B, H, S]
    valid = torch.arange(nb * bs, device=q.device)[None, :] < seq_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row is all -inf: zeros
    out.copy_(torch.einsum("bhs,bsc->bhc", p, lat[..., :c]).to(out.dtype))
    return out
