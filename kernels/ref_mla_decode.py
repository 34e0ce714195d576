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

from typing import TYPE_CHECKING

import torch

from kernels.kv_fp8 import from_cache, take

if TYPE_CHECKING:  # the Triton module's result type only; this reference runs without it
    from kernels.triton_mla_decode import UnmergedDecode


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


def mla_up_v_merged_ref(d: UnmergedDecode, seq_lens: torch.Tensor, w_uv: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """kernels/triton_mla_up_merge.mla_up_v_merged's contract: the decode kernel's splits
    (d's float32 partials and their log2-sum-exps) merged per (request, head) over the
    splits the request used, rounded to o_lat's dtype, then o_lat @ W_UV^T per head
    (w_uv [H, Dv, C]; float32, rounded once) into out [B, H, Dv]. One split: d.out is
    o_lat already."""
    b, h, c = d.out.shape
    if d.part_o is None:
        o_lat = d.out.float()
    else:
        s = d.num_splits
        lens = seq_lens.long()
        split_len = torch.full_like(lens, d.split_len)
        if d.dyn:  # each request spreads its context over the splits, at least split_len each
            per_split = torch.div(lens + s - 1, s, rounding_mode="floor")
            even = torch.div(per_split + d.block_n - 1, d.block_n,
                             rounding_mode="floor") * d.block_n
            split_len = torch.maximum(even, split_len)
        used = torch.clamp(torch.div(lens + split_len - 1, split_len, rounding_mode="floor"),
                           max=s)  # [B]
        valid = (torch.arange(s, device=lens.device)[None, :] < used[:, None])[:, None, :]
        part_o = d.part_o.view(b, h, s, d.cp)[..., :c]
        lse = d.part_lse.view(b, h, s).masked_fill(~valid, float("-inf"))
        top = lse.amax(dim=-1, keepdim=True).clamp_min(-1e30)  # a request without context
        wts = torch.exp2(lse - top)  # [B, H, S]; splits never written weigh 0
        merged = torch.where(valid[..., None], part_o, 0.0).mul(wts[..., None]).sum(2)
        total = wts.sum(-1, keepdim=True)
        o_lat = torch.where(total > 0, merged / total.clamp_min(1e-30), 0.0)
        o_lat = o_lat.to(d.out.dtype).float()
    out.copy_(torch.einsum("bhc,hdc->bhd", o_lat, w_uv.float()).to(out.dtype))
    return out
