"""DeepSeek's multi-head latent attention (MLA) over a paged latent cache.

Per token and layer the cache stores one latent row ``[c | k_pe]`` (engine/kv_layout.py,
kind "mla"): ``c`` is the compressed KV after kv_a_layernorm (C = kv_lora_rank values) and
``k_pe`` the roped key every head shares (R = qk_rope_head_dim). Keys and values per head
come from ``c`` through kv_b_proj, whose weight is, per head, W_UK [Dn, C] (the key's
non-rotated part) stacked on W_UV [Dv, C] (the value).

- Prefill (requests with more than one query in the step) decompresses the context's
  latent rows, prior chunks' included, into per-head k_nope and V (kv_b_proj) and runs
  MLA prefill attention (kernels/triton_mla_prefill.py) on them and the latent's shared
  k_pe: the FLOPs of ordinary attention at MLA's own head dims, nothing padded. In a
  mixed step (planned on the host, so the lengths are host lists) only the prefilling
  requests' own blocks are decompressed; the requests decoding beside them take the
  absorbed path. Without host lengths every block the tables name is decompressed
  (correct, and bounded by the tables' size).
- Decode runs in the absorbed form: q_nope goes through W_UK onto the latent, attention
  is multi-query over the latent rows themselves (kernels/triton_mla_decode.py), and the
  result goes through W_UV. A step then reads C + R values per token instead of
  H * (Dn + R + Dv).

A float8 cache (--kv-cache-dtype fp8) stores the latent divided by the layer's scale
(``kv_scale``, set by engine/kv_scales.py): the decode kernel reads it in-kernel, and the
prefill path multiplies the rows it decompresses back before kv_b_proj.

One kernel (kernels/triton_mla_latent.py) normalizes the new latent, rotates its rope key
and the queries' rope parts, and stores the row (with FUSED_LATENT_ABSORB, at a decode of
few rows, the same launch also runs the W_UK product); after load (`finish_load`) the q (or
q_a) and kv_a projections are one GEMM over a stacked weight.

Tensor parallelism: query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj columns)
split by head; q_a_proj, kv_a_proj_with_mqa and their norms are replicated, so every rank
computes and stores the same latent. o_proj is row-parallel: one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, KernelSet
from engine.config import ModelConfig
from engine.models.llama import RMSNorm
from engine.parallel.group import TPGroup
from engine.parallel.shards import TPShard
from engine.rope import softmax_mscale
from kernels.kv_fp8 import from_cache, take

# Up to this many decoding rows the two per-head products (q_nope @ W_UK, o_lat @ W_UV^T)
# run as Triton kernels (kernels/triton_mla_absorb.py: programmatic dependent launch, no
# cuBLAS batched-GEMM launch per product); past it, torch.bmm.
ABSORB_KERNEL_MAX_ROWS = 4
# Where the absorb kernel runs (above) beside the Triton latent kernel, both in one launch
# (kernels/triton_mla_latent_absorb.py: a launch less per layer, 27 a V2-Lite decode step).
# On since an H100 timed it (session 36: V2-Lite's step at batch 1 1.2% faster) and the
# -m gpu suite ran with it on (session 37; `bench/moe_bench.py --variants
# "engine.models.mla.FUSED_LATENT_ABSORB=False"` is the A/B; read at every forward, so a
# variant's recaptured graphs take it).
FUSED_LATENT_ABSORB = True
# Where the W_UV product runs as a Triton kernel (above), MLA decode's split merge inside it
# (kernels/triton_mla_up_merge.py: the merge's launch and o_lat's round trip go, 27 launches
# a V2-Lite decode step at batch 1, whose short contexts split). On since an H100 timed it
# (session 36: not slower, V2-Lite at batch 1 0.3% faster, within the runs' spread; 27
# launches fewer) and the -m gpu suite ran with it on (session 37); `bench/moe_bench.py
# --variants "engine.models.mla.FUSED_UP_MERGE=False"`.
FUSED_UP_MERGE = True


def latent_store_for(kernels: KernelSet) -> Callable[..., None]:
    """The latent kernel (kernels/ref_mla_latent.py's contract) of the kernel set's family:
    the Triton one beside Triton kernels (graph-safe), else the torch reference."""
    if kernels.name == "triton":
        from kernels.triton_mla_latent import mla_latent_store

        return mla_latent_store
    from kernels.ref_mla_latent import mla_latent_store_ref

    return mla_latent_store_ref


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: KernelSet, shard: TPShard,
                 group: TPGroup | None) -> None:
        super().__init__()
        self.h = shard.num_heads  # this rank's query heads
        self.dn, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.dv, self.c = cfg.v_head_dim, cfg.kv_lora_rank
        self.group = group
        self.k = kernels
        hidden, qk = cfg.hidden_size, self.dn + self.r
        if cfg.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden, self.h * qk, bias=False)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.c + self.r, bias=False)
        self.kv_a_layernorm = RMSNorm(self.c, cfg.rms_norm_eps, kernels)
        self.kv_b_proj = nn.Linear(self.c, self.h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.h * self.dv, hidden, bias=False)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        # YaRN's mscale correction (transformers' yarn_apply_mscale)
        self.scale = qk ** -0.5 * softmax_mscale(scaling)
        self.kv_scale = 1.0  # a float8 cache's latent scale for this layer
        self.latent_store = latent_store_for(kernels)
        # finish_load: q_proj's (or q_a_proj's) rows and kv_a_proj_with_mqa's in one weight,
        # [Nq + C + R, hidden]; the two Linear weights are then views of it
        self.fused_a: torch.Tensor | None = None

    def finish_load(self) -> None:
        """Stacks the two projections of the layer's input into one weight, so a step runs
        one GEMM for both (a launch less per layer at decode). Left apart where either is
        not a plain float Linear (an FP8 projection)."""
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        second = self.kv_a_proj_with_mqa
        if type(first) is not nn.Linear or type(second) is not nn.Linear:
            return
        a, b = first.weight, second.weight
        if a.dtype != b.dtype or a.device != b.device or not a.dtype.is_floating_point \
                or a.element_size() < 2:
            return
        fused = torch.cat([a.detach(), b.detach()])  # [Nq + C + R, hidden]
        n = a.shape[0]
        first.weight.data = fused[:n]
        second.weight.data = fused[n:]
        self.fused_a = fused

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; cos_sin [max_pos, R]; kv_layer [NB, 1, BS, 1, C + R]."""
        t = x.shape[0]
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        assert first is not None
        if self.fused_a is not None:  # [q or q_a | kv_a] in one GEMM, then column views
            both = F.linear(x, self.fused_a)  # [T, Nq + C + R]
            n = first.out_features
            a, kv_a = both[:, :n], both[:, n:]
        else:
            a, kv_a = first(x), self.kv_a_proj_with_mqa(x)  # kv_a [T, C + R]
        if self.q_proj is not None:
            q = a
        else:
            assert self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(a)[0])
        q = q.view(t, self.h, self.dn + self.r)
        # one kernel: the latent [norm(c) | rope(k_pe)] into the cache, q_pe roped (in
        # place, or at decode straight into the absorbed query's rope columns).
        # DeepSeek's interleaved rope pairs were de-interleaved in the weights at load
        # (load_weights), so the rotate-half rotation applies.
        q_abs = q.new_empty(t, self.h, self.c + self.r) if meta.decode_only else None
        q_nope, q_pe = q.split([self.dn, self.r], dim=-1)  # [T, H, Dn], [T, H, R]
        fused = q_abs is not None and self._fused_latent_absorb(t)
        if fused:  # that kernel and q_nope @ W_UK (into q_abs's first C columns) as one
            from kernels.triton_mla_latent_absorb import mla_latent_absorb
            assert q_abs is not None
            mla_latent_absorb(kv_a, q, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                              positions, cos_sin, kv_layer, meta.slot_mapping, q_nope,
                              self._w_uk_uv()[0], q_abs[..., :self.c], scale=self.kv_scale,
                              q_pe_out=q_abs[..., self.c:])
        else:
            self.latent_store(kv_a, q, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                              positions, cos_sin, kv_layer, meta.slot_mapping,
                              scale=self.kv_scale,
                              q_pe_out=None if q_abs is None else q_abs[..., self.c:])
        if q_abs is not None:
            o = self._decode(q_nope, None, kv_layer, meta.block_tables, meta.seq_lens,
                             meta.max_seq_len, q_abs, absorbed=fused)
        elif meta.cu_seqlens_q_host is not None and meta.seq_lens_host is not None:
            o = self._mixed(q_nope, q_pe, kv_layer, meta, _split_of(meta, kv_layer.shape[2]))
        else:
            o = self._prefill(q_nope, q_pe, kv_layer, meta.block_tables, meta.cu_seqlens_q,
                              meta.seq_lens)
        out = self.o_proj(o.reshape(t, self.h * self.dv))
        return out if self.group is None else self.group.all_reduce(out)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK [H, Dn, C] and W_UV [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.c)
        return w[:, :self.dn], w[:, self.dn:]

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor | None,
                kv_layer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                max_seq_len: int | None, q: torch.Tensor | None = None,
                absorbed: bool = False) -> torch.Tensor:  # [B, H, Dv]
        """One query per request, in the absorbed form. q: the absorbed query [B, H, C + R]
        whose rope columns already hold the rotated q_pe (q_pe is then None); the W_UK
        product is written into its first C columns, so no concatenation runs (absorbed:
        it is there already, the fused latent kernel wrote it). The W_UV product is
        written in [B, H, Dv] order for o_proj (no copy at B > 1)."""
        w_uk, w_uv = self._w_uk_uv()
        b = q_nope.shape[0]
        if q is None:
            assert q_pe is not None
            q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe],
                          dim=-1)  # [B, H, C + R]
        elif not absorbed:
            if self._absorb_kernels(b):
                from kernels.triton_mla_absorb import mla_absorb_q
                mla_absorb_q(q_nope, w_uk, q[..., :self.c])
            else:
                torch.bmm(q_nope.transpose(0, 1), w_uk, out=q.transpose(0, 1)[..., :self.c])
        assert self.k.mla_decode is not None
        if FUSED_UP_MERGE and self._absorb_kernels(b):  # the Triton set: its mla_decode
            from kernels.triton_mla_decode import mla_decode_unmerged
            from kernels.triton_mla_up_merge import mla_up_v_merged
            d = mla_decode_unmerged(q, kv_layer, block_tables, seq_lens, self.scale, self.c,
                                    max_seq_len=max_seq_len, kv_scale=self.kv_scale)
            return mla_up_v_merged(d, seq_lens, w_uv, q.new_empty(b, self.h, self.dv))
        o_lat = self.k.mla_decode(q, kv_layer, block_tables, seq_lens, self.scale, self.c,
                                  max_seq_len=max_seq_len, kv_scale=self.kv_scale)  # [B, H, C]
        o = o_lat.new_empty(b, self.h, self.dv)
        if self._absorb_kernels(b):
            from kernels.triton_mla_absorb import mla_up_v
            mla_up_v(o_lat, w_uv, o)
        else:
            torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return o

    def _absorb_kernels(self, rows: int) -> bool:
        """The per-head products as Triton kernels (few rows, beside Triton kernels)."""
        return self.k.name == "triton" and rows <= ABSORB_KERNEL_MAX_ROWS

    def _fused_latent_absorb(self, rows: int) -> bool:
        """The latent kernel and the W_UK product in one launch (FUSED_LATENT_ABSORB): where
        the product runs as a Triton kernel and the latent kernel is the Triton one, which
        the fused kernel's latent part is (a float8 cache included: its scale goes along).
        Else (the switch off, more rows, the torch references) the two run apart."""
        if not (FUSED_LATENT_ABSORB and self._absorb_kernels(rows)):
            return False
        from kernels.triton_mla_latent import mla_latent_store
        return self.latent_store is mla_latent_store

    def _mixed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
               meta: AttentionMetadata, sp: _Split) -> torch.Tensor:  # [T, H, Dv]
        """Decoding rows absorbed, prefilling requests on their own decompressed blocks."""
        o = q_nope.new_empty(q_nope.shape[0], self.h, self.dv)
        if sp.dec_rows is not None:
            assert sp.dec_reqs is not None
            o[sp.dec_rows] = self._decode(
                q_nope[sp.dec_rows], q_pe[sp.dec_rows], kv_layer,
                meta.block_tables[sp.dec_reqs], meta.seq_lens[sp.dec_reqs], sp.dec_max_len)
        for g in sp.groups:  # their own blocks only, a bounded number of tokens at a time
            blocks = meta.block_tables.reshape(-1)[g.blocks]  # [Nb]
            if g.rows is None:  # one run of rows: views in, the kernel writes o itself
                r0, r1 = g.span
                self._prefill(q_nope[r0:r1], q_pe[r0:r1], kv_layer, blocks, g.cu, g.lens,
                              g.starts, out=o[r0:r1])
            else:
                o[g.rows] = self._prefill(q_nope[g.rows], q_pe[g.rows], kv_layer, blocks,
                                          g.cu, g.lens, g.starts)
        return o

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor, starts: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # [T, H, Dv]
        """Decompresses the blocks `block_tables` names (this rank's heads) and runs MLA
        prefill attention on them. block_tables: [B, W] (every entry is decompressed,
        padding too: no host sync) with starts None, or the flat [Nb] blocks of a prefill
        group, each request's a run of consecutive entries whose first decompressed row is
        `starts` [B] (``_split_of``). out: where the result goes (a view of the step's
        output), else a new tensor."""
        bt = block_tables
        bs = kv_layer.shape[2]
        lat = take(kv_layer, (bt.reshape(-1).long(), 0, slice(None), 0))  # [Nb, BS, C + R]
        lat = from_cache(lat, self.kv_scale, q_nope.dtype)  # a float8 cache's rows, scaled
        lat = lat.reshape(-1, self.c + self.r)  # [Nb * BS, C + R]: context rows, in order
        # [Nb * BS, H, Dn + Dv]: per head k_nope then v, read in place by the kernel (no
        # padded copy: k_pe stays one row per token in the latent)
        kv = self.kv_b_proj(lat[:, :self.c]).view(lat.shape[0], self.h, self.dn + self.dv)
        if starts is None:  # request b's blocks are rows b * W .. of the decompression
            starts = torch.arange(bt.shape[0], device=bt.device) * (bt.shape[1] * bs)
        assert self.k.mla_prefill is not None
        return self.k.mla_prefill(q_nope, q_pe, kv, lat[:, self.c:], starts, cu_seqlens_q,
                                  seq_lens, self.scale, out)


# Context tokens one decompression holds at most (more only for a single request whose
# context alone is longer): bounds the dense K/V workspace of a step that prefills several
# long requests, H x (Dn + Dv) values per token (V2-Lite: 8 KiB a token in bf16).
PREFILL_GROUP_TOKENS = 16384


@dataclass(frozen=True)
class _PrefillGroup:
    """Prefilling requests decompressed together, as device index tensors."""

    # [Tp] int64: every token row of these requests; None where they are one run of rows,
    # `span` (a prefill-only step's, or prefills after the decoding rows): the queries are
    # then views and the kernel writes the output in place, where gathering them and
    # scattering the output back cost three copies of [Tp, H, D] a layer
    rows: torch.Tensor | None
    span: tuple[int, int]  # [first row, end) of the group's rows when they are one run
    blocks: torch.Tensor  # [Nb] int64: flat indices into block_tables of their blocks
    starts: torch.Tensor  # [Bp] int64: request p's first row of their decompression
    cu: torch.Tensor  # [Bp + 1] int32: their queries among the Tp rows
    lens: torch.Tensor  # [Bp] int32


@dataclass(frozen=True)
class _Split:
    """A mixed step's requests split by kind (made once per step: every MLA layer reads it)."""

    dec_rows: torch.Tensor | None  # [Bd] int64: the token row of each decoding request
    dec_reqs: torch.Tensor | None  # [Bd] int64: its request index (None: no decoding rows)
    dec_max_len: int  # longest decoding context (the decode kernel's split hint)
    groups: tuple[_PrefillGroup, ...]


def _split_of(meta: AttentionMetadata, block_size: int) -> _Split:
    """The step's split, built from the host lengths at the first MLA layer and kept on
    the metadata for the others."""
    cached = getattr(meta, "_mla_split", None)
    if isinstance(cached, _Split):
        return cached
    cu, lens = meta.cu_seqlens_q_host, meta.seq_lens_host
    assert cu is not None and lens is not None
    dev = meta.block_tables.device
    width = meta.block_tables.shape[1]

    def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)

    dec = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    pre = [b for b in range(len(lens)) if cu[b + 1] - cu[b] > 1]
    batches: list[list[int]] = []
    held = 0
    for b in pre:  # in order, a new group once the next request would pass the cap
        if not batches or held + lens[b] > PREFILL_GROUP_TOKENS:
            batches.append([])
            held = 0
        batches[-1].append(b)
        held += lens[b]
    groups = []
    for batch in batches:
        rows: list[int] = []
        flat: list[int] = []
        starts: list[int] = []
        group_cu = [0]
        for b in batch:
            rows.extend(range(cu[b], cu[b + 1]))
            group_cu.append(len(rows))
            n = -(-lens[b] // block_size)
            starts.append(len(flat) * block_size)
            flat.extend(range(b * width, b * width + n))
        run = rows[-1] - rows[0] + 1 == len(rows)  # rows ascend: a run iff no gap
        groups.append(_PrefillGroup(
            rows=None if run else tensor(rows, torch.int64), span=(rows[0], rows[-1] + 1),
            blocks=tensor(flat, torch.int64),
            starts=tensor(starts, torch.int64),
            cu=tensor(group_cu, torch.int32), lens=tensor([lens[b] for b in batch],
                                                          torch.int32)))
    split = _Split(
        dec_rows=tensor([cu[b] for b in dec], torch.int64) if dec else None,
        dec_reqs=tensor(dec, torch.int64) if dec else None,
        dec_max_len=max((lens[b] for b in dec), default=0), groups=tuple(groups))
    meta._mla_split = split  # type: ignore[attr-defined]
    return split
