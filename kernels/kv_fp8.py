"""FP8 KV cache values: how a float becomes a cache entry and back (the torch side).

A float8_e4m3fn pool stores ``x / scale`` with one scale per layer for K and one for V,
saturated to e4m3's largest finite value (448): torch's cast and Triton's both round to
nearest even, but only an explicit clamp keeps an outlier finite. Readers multiply by the
scale after the cast back, so attention sees ``fp8(x / scale) * scale``. Triton kernels do
the same arithmetic in-kernel; this module is what the references and the engine's torch
code (MLA's latent decompression) use.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as cache entries of ``dtype``: divided by ``scale`` and saturated for fp8, a
    plain cast otherwise (a float cache has no scale)."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (anything else as is): torch has no float8 kernels
    for some indexing ops on some devices (CPU's index_copy_), and byte copies are exact."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def take(t: torch.Tensor, index: tuple) -> torch.Tensor:
    """``t[index]`` (advanced indexing), through a byte view for a float8 tensor."""
    if t.dtype != FP8_DTYPE:  # one op: the reference decode calls this once per layer
        return t[index]
    return t.view(torch.uint8)[index].view(t.dtype)


def put(t: torch.Tensor, index: tuple, values: torch.Tensor) -> None:
    """``t[index] = values`` (values already in t's dtype), through byte views for float8."""
    as_bytes(t)[index] = as_bytes(values)


def from_cache(t: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache entries as ``dtype`` values: an fp8 entry times its scale."""
    if t.dtype != FP8_DTYPE:
        return t.to(dtype)
    return (t.float() * scale).to(dtype)
