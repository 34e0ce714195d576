"""Plain-torch reference of MLA prefill attention on the decompressed context
(kernels/triton_mla_prefill.py's contract).

Each request's chunk of ``n_q`` queries (rows ``cu[b]:cu[b+1]``) attends causally on its
context of ``lens[b]`` tokens, whose decompressed rows start at ``starts[b]``: per head the
key is ``[k_nope | k_pe]`` (k_pe shared by every head) and the value ``v``, both from
``kv`` (k_nope then v per head) and ``k_pe``. Query ``j`` sits at position
``lens[b] - n_q + j``. Scores and softmax in float32 whatever the dtype. Lengths are read
on the host (a reference, not graph-safe).
"""

from __future__ import annotations

import torch


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, Dn]
    q_pe: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [N, H, Dn + Dv]
    k_pe: torch.Tensor,  # [N, R]
    starts: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, Dv]
) -> torch.Tensor:  # [T, H, Dv]
    t, h, dn = q_nope.shape
    dv = kv.shape[2] - dn
    if out is None:
        out = q_nope.new_empty(t, h, dv)
    cu, lens, st = cu_seqlens_q.tolist(), seq_lens.tolist(), starts.tolist()
    for b, (length, start) in enumerate(zip(lens, st, strict=True)):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        keys = kv[start:start + length].float()  # [L, H, Dn + Dv]
        kn, v = keys[..., :dn], keys[..., dn:]
        kp = k_pe[start:start + length].float()  # [L, R]
        s = (torch.einsum("qhd,khd->hqk", q_nope[q0:q1].float(), kn)
             + torch.einsum("qhr,kr->hqk", q_pe[q0:q1].float(), kp)) * scale
        qpos = torch.arange(length - (q1 - q0), length, device=s.device)
        seen = torch.arange(length, device=s.device)[None, :] <= qpos[:, None]  # [Q, L]
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)
    return out
