"""The shape of a worker's paged KV cache, and the fingerprint peers compare before a transfer.

Block-major: the cache is one contiguous tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, so block ``i`` (every
layer's K and V for ``block_size`` tokens) is the contiguous byte range
``[i * block_nbytes, (i + 1) * block_nbytes)`` and a run of adjacent blocks is one region.
This module imports no torch so transfer and service code can use it freely.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    model: str  # model identity (name or path) the KV was computed with
    dtype: str  # "float32" | "bfloat16" | "float16"
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # blocks in this worker's pool (not part of the fingerprint)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype: unknown KV dtype {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * DTYPE_SIZES[self.dtype]

    @property
    def pool_nbytes(self) -> int:
        return self.block_nbytes * self.num_blocks

    def fingerprint(self) -> str:
        """Identity of the byte layout of one block; equal fingerprints mean compatible KV."""
        key = (f"{self.model}|{self.dtype}|{self.block_size}|{self.num_layers}|"
               f"{self.num_kv_heads}|{self.head_dim}")
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def describe_mismatch(self, other: KVLayout) -> str:
        """Names every field that differs, for the error a failed handshake raises."""
        diffs = [
            f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}"
            for f in ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
            if getattr(self, f) != getattr(other, f)
        ]
        return "; ".join(diffs) if diffs else "layouts match"
