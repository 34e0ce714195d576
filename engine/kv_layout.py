"""The shape of a worker's paged KV cache, and the fingerprint peers compare before a transfer.

Block-major: the cache is one contiguous tensor
``[num_blocks, num_layers, planes, block_size, head_count, head_dim]``, so block ``i``
(every layer's KV for ``block_size`` tokens) is the contiguous byte range
``[i * block_nbytes, (i + 1) * block_nbytes)`` and a run of adjacent blocks is one region.

What a token stores per layer (``kind``):

- ``"kv"`` (``planes`` 2): K and V, ``num_kv_heads`` heads of ``head_dim`` each;
- ``"mla"`` (``planes`` 1): DeepSeek's MLA latent, one "head" of ``kv_lora_rank +
  qk_rope_head_dim`` values (the normed compressed KV, then the roped shared key); V is
  not stored, it is decompressed from the latent. ``num_kv_heads`` is 1.

``planes`` is an int field (not a string kind) because a transfer handshake sends the
layout's fields and accepts only ints beside model and dtype.

Tensor parallelism: ``num_kv_heads`` is the model's TOTAL KV heads; a worker of
``tp_size`` N has N ranks and rank r's pool holds only its heads, ``head_count`` of them
from ``head_start``. With H >= N heads (N divides H) rank r holds ``[r*H/N, (r+1)*H/N)``;
with H < N (H divides N) each head is replicated on N/H ranks and rank r holds head
``r*H // N``. Both cases are ``head_start = r*H // N``, ``head_count = max(1, H // N)``.
An MLA latent is that second case with H = 1: every rank holds the whole latent (it is
not split by heads; each rank's query heads read all of it).
FP8 (``--kv-cache-dtype fp8``): ``dtype`` is the pool's element dtype, ``float8_e4m3fn``,
and ``kv_scales`` holds each layer's K and V scale (``[k0, v0, k1, v1, ...]``; an MLA
latent uses the K one): the cache holds ``x / scale`` and readers multiply it back. The
scales are part of the KV's content, so they are in the fingerprint: peers whose scales
differ would read each other's bytes as other numbers.

This module imports no torch so transfer and service code can use it freely.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
SCALED_DTYPES = ("float8_e4m3fn",)  # pools that store x / scale, with per-layer scales
# what must be equal between peers for their KV to be the same numbers (not the TP split)
MATCHED_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                  "planes", "kv_scales")
PLANES = {"kv": 2, "mla": 1}  # kind -> planes: what one token of one layer stores
MAX_TP = 256  # ranks of one worker; bounds what a peer's handshake can make us compute


def check_tp(num_kv_heads: int, tp_size: int, what: str = "tp_size") -> None:
    """Raises ValueError naming ``what`` unless ``tp_size`` ranks can split the heads."""
    if not 1 <= tp_size <= MAX_TP:
        raise ValueError(f"{what}: must be in [1, {MAX_TP}], got {tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"{what}: {tp_size} ranks cannot split {num_kv_heads} KV heads "
                         "(one must divide the other)")


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first head, head count) rank ``tp_rank`` of ``tp_size`` holds."""
    check_tp(num_kv_heads, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} outside [0, {tp_size})")
    return tp_rank * num_kv_heads // tp_size, max(1, num_kv_heads // tp_size)


def kv_shape_of(cfg: ModelConfig) -> dict[str, int]:
    """KVLayout's fields for what a token of this model stores per layer: its K/V heads, or
    (MLA) the latent, kv_lora_rank + qk_rope_head_dim values."""
    if cfg.is_mla:
        return KVLayout.kv_shape("mla", 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return KVLayout.kv_shape("kv", cfg.num_kv_heads, cfg.head_dim)


@dataclass(frozen=True)
class KVLayout:
    model: str  # model identity (name or path) the KV was computed with
    dtype: str  # "float32" | "bfloat16" | "float16"
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int  # the model's total KV heads (a TP rank's pool holds head_count)
    head_dim: int
    num_blocks: int  # blocks in this worker's pool (not part of the fingerprint)
    tp_size: int = 1  # ranks of the worker (not part of the fingerprint)
    tp_rank: int = 0  # which rank's pool this is
    planes: int = 2  # 2: K and V heads (kind "kv"); 1: one MLA latent (kind "mla")
    # float8 pools: [k_scale, v_scale] per layer, flattened (2 * num_layers); else empty
    kv_scales: tuple[float, ...] = ()

    @staticmethod
    def kv_shape(kind: str, num_kv_heads: int, head_dim: int) -> dict[str, int]:
        """The fields that say what a token stores: K/V heads, or an MLA latent of
        ``head_dim`` (kv_lora_rank + qk_rope_head_dim) values, one head on every rank."""
        if kind not in PLANES:
            raise ValueError(f"kind: must be one of {sorted(PLANES)}, got {kind!r}")
        heads = 1 if kind == "mla" else num_kv_heads
        return {"num_kv_heads": heads, "head_dim": head_dim, "planes": PLANES[kind]}

    @property
    def kind(self) -> str:
        return "mla" if self.planes == 1 else "kv"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: unknown KV dtype {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.planes not in PLANES.values():
            raise ValueError(f"planes: must be 2 (K/V) or 1 (MLA latent), got {self.planes!r}")
        if self.planes == 1 and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: an MLA latent is one head, got {self.num_kv_heads}")
        for name in ("tp_size", "tp_rank"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name}: expected an int, got {getattr(self, name)!r}")
        head_range(self.num_kv_heads, self.tp_size, self.tp_rank)  # raises naming the field
        self._check_scales()

    def _check_scales(self) -> None:
        """Coerces kv_scales to a tuple of floats (a peer sends a list) and checks it."""
        raw = self.kv_scales
        if not isinstance(raw, (tuple, list)) or not all(
                type(x) in (float, int) for x in raw):
            raise ValueError(f"kv_scales: expected a list of numbers, got {raw!r:.60}")
        scales = tuple(float(x) for x in raw)
        object.__setattr__(self, "kv_scales", scales)
        if self.dtype not in SCALED_DTYPES:
            if scales:
                raise ValueError(f"kv_scales: a {self.dtype} pool has no scales, got "
                                 f"{len(scales)}")
            return
        if len(scales) != 2 * self.num_layers:
            raise ValueError(f"kv_scales: a {self.dtype} pool needs a K and a V scale per "
                             f"layer ({2 * self.num_layers}), got {len(scales)}")
        bad = next((x for x in scales if not (math.isfinite(x) and x > 0)), None)
        if bad is not None:
            raise ValueError(f"kv_scales: each must be finite and > 0, got {bad!r}")

    @property
    def head_start(self) -> int:
        """First of this rank's KV heads, in the model's numbering."""
        return head_range(self.num_kv_heads, self.tp_size, self.tp_rank)[0]

    @property
    def head_count(self) -> int:
        """KV heads in this rank's pool (all of them at TP1)."""
        return head_range(self.num_kv_heads, self.tp_size, self.tp_rank)[1]

    @property
    def head_nbytes(self) -> int:
        """One head of one token of one layer's K (or V, or the MLA latent)."""
        return self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [num_layers, planes, block_size, head_count, head_dim]."""
        return (self.num_layers, self.planes, self.block_size, self.head_count, self.head_dim)

    @property
    def rows_per_block(self) -> int:
        """Token rows of one block (each ``head_count * head_nbytes`` bytes)."""
        return self.num_layers * self.planes * self.block_size

    @property
    def block_nbytes(self) -> int:
        return self.rows_per_block * self.head_count * self.head_nbytes

    @property
    def pool_nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    def fingerprint(self) -> str:
        """Identity of the KV's content: equal fingerprints mean the same numbers, whatever
        the TP split (a TP2 producer and a TP1 consumer of one model match)."""
        key = (f"{self.model}|{self.dtype}|{self.block_size}|{self.num_layers}|"
               f"{self.num_kv_heads}|{self.head_dim}")
        if self.planes != 2:  # a K/V pool keeps the fingerprint it had before MLA existed
            key += f"|{self.kind}"
        if self.kv_scales:  # repr: the shortest text that reads back as the same float
            key += "|scales=" + ",".join(repr(x) for x in self.kv_scales)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def describe_mismatch(self, other: KVLayout) -> str:
        """Names every field that differs, for the error a failed handshake raises."""
        diffs = [
            f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}"
            for f in MATCHED_FIELDS
            if f != "kv_scales" and getattr(self, f) != getattr(other, f)
        ]
        if self.kv_scales != other.kv_scales:
            diffs.append(_scales_diff(self.kv_scales, other.kv_scales))
        return "; ".join(diffs) if diffs else "layouts match"


def _scales_diff(a: tuple[float, ...], b: tuple[float, ...]) -> str:
    """kv_scales' difference in a line: the first layer whose K or V scale differs (a
    model has up to ~100 layers: the whole tuples would drown the message)."""
    if len(a) != len(b) or not a:
        return f"kv_scales: {len(a)} scales != {len(b)}"
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    n = sum(x != y for x, y in zip(a, b, strict=True))
    return (f"kv_scales: layer {i // 2} {'KV'[i % 2]} scale {a[i]!r} != {b[i]!r} "
            f"({n} of {len(a)} scales differ)")
