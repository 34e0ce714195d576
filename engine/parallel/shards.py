"""Which slice of the model each tensor-parallel rank owns, and the TP-size checks.

Attention heads split evenly. KV heads split evenly when there are at least as many as
ranks; with fewer, each rank keeps the one KV head its query heads read (replicated over
tp / num_kv_heads ranks). MLP columns split evenly; the vocabulary splits in equal padded
shards (the last may hold fewer real rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ModelConfig

if TYPE_CHECKING:
    import torch

FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    q_start: int  # first query head of this rank
    num_heads: int  # query heads on this rank
    kv_start: int  # first KV head of this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    inter_start: int  # first MLP column (of gate and of up) of this rank
    inter_size: int
    vocab_start: int  # first vocabulary row of this rank
    vocab_shard: int  # rows per rank (padded), ceil(vocab / size)
    vocab_rows: int  # real rows on this rank (<= vocab_shard)


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ValueError naming the flag when `size` cannot split this model."""
    if size < 1:
        raise ValueError(f"{FLAG}: must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"{FLAG}: {size} does not divide the model's {cfg.num_heads} "
                         "attention heads")
    kv = cfg.num_kv_heads
    if kv >= size and kv % size:
        raise ValueError(f"{FLAG}: {size} does not divide the model's {kv} KV heads")
    if kv < size and size % kv:
        raise ValueError(f"{FLAG}: {size} is not a multiple of the model's {kv} KV heads "
                         "(needed to replicate them)")
    if cfg.intermediate_size % size:
        raise ValueError(f"{FLAG}: {size} does not divide the model's intermediate size "
                         f"{cfg.intermediate_size}")
    if cfg.moe is not None and cfg.moe.num_experts % size:  # experts split whole
        raise ValueError(f"{FLAG}: {size} does not divide the model's "
                         f"{cfg.moe.num_experts} experts")


def shard_for(cfg: ModelConfig, rank: int, size: int) -> TPShard:
    check_tp(cfg, size)
    nq = cfg.num_heads // size
    if cfg.num_kv_heads >= size:
        nkv = cfg.num_kv_heads // size
        kv_start = rank * nkv
    else:  # replicated: rank r's query heads all read KV head r // (size / num_kv_heads)
        nkv = 1
        kv_start = rank // (size // cfg.num_kv_heads)
    inter = cfg.intermediate_size // size
    vshard = -(-cfg.vocab_size // size)
    vstart = rank * vshard
    return TPShard(rank, size, rank * nq, nq, kv_start, nkv, rank * inter, inter,
                   vstart, vshard, max(0, min(vshard, cfg.vocab_size - vstart)))


def hf_slice(shard: TPShard, name: str, head_dim: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the HF-named tensor this rank reads; None: the whole tensor."""
    if shard.size == 1:
        return None
    d = head_dim
    if ".q_proj." in name:
        return 0, shard.q_start * d, (shard.q_start + shard.num_heads) * d
    if ".k_proj." in name or ".v_proj." in name:
        return 0, shard.kv_start * d, (shard.kv_start + shard.num_kv_heads) * d
    if ".o_proj." in name:
        return 1, shard.q_start * d, (shard.q_start + shard.num_heads) * d
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, shard.inter_start, shard.inter_start + shard.inter_size
    if ".down_proj." in name:
        return 1, shard.inter_start, shard.inter_start + shard.inter_size
    if "embed_tokens." in name or name.removeprefix("model.").startswith("lm_head."):
        return 0, shard.vocab_start, shard.vocab_start + shard.vocab_rows
    return None  # norms (q/k norms act per head_dim) are replicated


def local_from_full(shard: TPShard, cfg: ModelConfig, name: str, full: torch.Tensor
                    ) -> torch.Tensor:
    """This rank's part of a full (TP1-shaped) parameter of our fused layout, so random
    dummy weights equal TP1's, sliced."""
    import torch

    d = cfg.head_dim
    if ".qkv_proj." in name:
        q, k, v = full.split([cfg.num_heads * d, cfg.num_kv_heads * d,
                              cfg.num_kv_heads * d], dim=0)
        parts = [_take(shard, f"x.{n}.w", t, d) for n, t in
                 (("q_proj", q), ("k_proj", k), ("v_proj", v))]
        return torch.cat(parts, dim=0)
    if ".gate_up_proj." in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_take(shard, "x.gate_proj.w", gate, d),
                          _take(shard, "x.up_proj.w", up, d)], dim=0)
    out = _take(shard, name, full, d)
    if ("embed_tokens." in name or name.startswith("lm_head.")) \
            and out.shape[0] < shard.vocab_shard:
        pad = full.new_zeros(shard.vocab_shard - out.shape[0], *full.shape[1:])
        out = torch.cat([out, pad], dim=0)
    return out


def _take(shard: TPShard, name: str, t: torch.Tensor, head_dim: int) -> torch.Tensor:
    s = hf_slice(shard, name, head_dim)
    return t if s is None else t.narrow(s[0], s[1], s[2] - s[1])
