"""Counter-based uniform noise: the draw for a token is a pure function of (seed, position).

No generator state is carried between steps, so a token sampled on a producer and the next
one sampled on a consumer get the same draws they would get on one colocated engine, in any
batch. Integer hashing in int64 tensors gives bit-identical values on CPU and GPU.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so a 32-bit value times it fits in int64 without overflow


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche mix of int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[S] int64 seeds (< 2**63) and positions -> [S] int64 32-bit keys."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    return _hash32(_hash32(_hash32(lo) ^ hi) ^ (positions & _M32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 in (0, 1); row s depends only on (seeds[s], positions[s])."""
    keys = row_keys(seeds, positions)  # [S]
    cols = _hash32(torch.arange(vocab, dtype=torch.int64, device=seeds.device) * 0x9E37 & _M32)
    bits = _hash32(keys[:, None] ^ cols[None, :])  # [S, V], 32 random bits each
    # 24 bits are exact in float32, and the +0.5 keeps the value strictly inside (0, 1).
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
