"""Launcher helpers shared by the Triton kernels: argument checks and dtype choices.

Importing this imports triton; nothing in ``kernels/__init__.py`` imports it, so the CPU
engine and the test conftest (which must set ``TRITON_INTERPRET`` first) stay in control.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# a KV cache may also be float8 (x / scale per layer, kernels/kv_fp8.py)
KV_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def check(cond: bool, msg: str) -> None:
    """Launcher argument check: a bad call is the caller's error, so ValueError, not assert."""
    if not cond:
        raise ValueError(msg)


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    # Messages are built only on failure: these run on every launch, on the host's hot path.
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_paged_qkv(q: torch.Tensor, kv_layer: torch.Tensor, q_shape: str) -> tuple[int, int, int]:
    """Shared checks of the paged-attention launchers; returns (hq, hkv, block_size)."""
    check(q.dim() == 3, f"q: expected {q_shape}")
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: expected [NB, 2, BS, Hkv, D]")
    hq, d = q.shape[1], q.shape[2]
    _, _, bs, hkv, dk = kv_layer.shape
    check(dk == d, f"head_dim mismatch: q {d}, kv {dk}")
    check(d >= 16 and (d & (d - 1)) == 0, f"head_dim {d} must be a power of two >= 16")
    check(hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}")
    return hq, hkv, bs


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one of {FLOAT_DTYPES}")


def check_kv(name: str, t: torch.Tensor) -> None:
    """A KV cache: a float dtype, or float8_e4m3fn."""
    if t.dtype not in KV_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one of {KV_DTYPES}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32/int64, got {t.dtype}")


def check_device(*ts: torch.Tensor) -> None:
    dev = ts[0].device
    for t in ts:
        if t.device != dev:
            raise ValueError(f"tensors on different devices: {[str(x.device) for x in ts]}")


def compute_dtype(t: torch.Tensor) -> tl.dtype:
    """The dtype a kernel does its matrix products in.

    On the GPU that is the storage dtype (bf16/fp16 tensor cores, fp32 accumulate). CPU tensors
    mean the Triton interpreter, whose numpy emulation gets bf16 arithmetic wrong, so there
    every loaded value is upcast to float32 first.
    """
    return _TL_DTYPE[t.dtype] if t.is_cuda else tl.float32


def kv_compute_dtype(q: torch.Tensor, kv: torch.Tensor) -> tl.dtype:
    """The dtype attention's products run in: the cache's, or for a float8 cache the
    query's (its entries are upcast on load; the scale is applied outside the product)."""
    return compute_dtype(q if is_fp8(kv) else kv)


def kv_fp16_products(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """A float8 cache read by 16-bit queries on the GPU does its products in fp16: e4m3
    widens to fp16 in one instruction per two values but to bf16 only through float32 (one
    more per value), which bound the float8 decode kernel at twice its byte floor; e4m3's
    range (448) fits fp16's, whose mantissa is wider than bf16's. The query is clamped to
    fp16's range before its cast (a component past 65504 would be inf)."""
    return is_fp8(kv) and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def kv_ieee(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """float32 products in IEEE precision (not TF32): a float32 cache, or a float8 cache
    read by float32 queries."""
    return (q if is_fp8(kv) else kv).dtype == torch.float32


def inner_contiguous(t: torch.Tensor) -> bool:
    """True when every dim but the first is laid out contiguously (dim 0 may be strided)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
