"""Triton ``store_kv`` and ``store_latent``: write the step's new K/V rows (or MLA latent
rows) into paged blocks (see ref_kv.py). A float8 cache gets ``x / scale``, saturated
(``_to_cache``; kernels/kv_fp8.py is the torch side)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    check,
    check_device,
    check_float,
    check_int,
    check_kv,
    check_shape,
    is_fp8,
)


@triton.jit
def _to_cache(x, scale, ty, FP8: tl.constexpr):
    """x as cache entries of type ty: a plain cast, or (FP8) x / scale saturated to e4m3."""
    if FP8:
        y = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(ty)  # e4m3's largest finite
    return x.to(ty)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, kv_ptr, slot_ptr,
    s_kt, s_kh, s_kd,  # key strides
    s_vt, s_vh, s_vd,  # value strides
    s_cb, s_ckv, s_cs, s_ch, s_cd,  # kv_layer strides [NB, 2, BS, Hkv, D]
    k_scale, v_scale,  # FP8: what the cache entries are multiplied by when read
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    # One program per token: a token's K and V for all heads are one [Hkv, D] tile each.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BS
    off = slot - blk * BS
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(key_ptr + t * s_kt + h * s_kh + d * s_kd, mask=mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(value_ptr + t * s_vt + h * s_vh + d * s_vd, mask=mask)
    dst = kv_ptr + blk * s_cb + off * s_cs + h * s_ch + d * s_cd
    ty = kv_ptr.dtype.element_ty
    tl.store(dst, _to_cache(k, k_scale, ty, FP8), mask=mask)
    tl.store(dst + s_ckv, _to_cache(v, v_scale, ty, FP8), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D], any strides
    slot_mapping: torch.Tensor,  # [T] int32/int64, slot = block * BS + offset; < 0 skips
    *,
    k_scale: float = 1.0,  # float8 cache: this layer's K and V scales
    v_scale: float = 1.0,
) -> None:
    num_tokens, hkv, d = key.shape
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: expected [NB, 2, BS, Hkv, D]")
    check_shape("value", value, key.shape)
    check_shape("kv_layer[0, 0, 0]", kv_layer[0, 0, 0], (hkv, d))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_float("key", key)
    check_float("value", value)
    check_kv("kv_layer", kv_layer)
    check_int("slot_mapping", slot_mapping)
    check_device(key, value, kv_layer, slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_layer, slot_mapping,
        *key.stride(), *value.stride(), *kv_layer.stride(), float(k_scale), float(v_scale),
        HKV=hkv, D=d, BS=kv_layer.shape[2],
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        FP8=is_fp8(kv_layer), num_warps=4,
    )


@triton.jit
def _store_latent_kernel(
    src_ptr, kv_ptr, slot_ptr,
    s_t,  # latent row stride; D is contiguous
    s_cb, s_cs,  # kv_layer strides of the block and the token [NB, 1, BS, 1, D]
    scale,  # FP8: what the cache entries are multiplied by when read
    D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (a graph's padding row): nothing to write
        return
    blk = slot // BS
    d = tl.arange(0, BLOCK_D)
    row = tl.load(src_ptr + t * s_t + d, mask=d < D)
    tl.store(kv_ptr + blk * s_cb + (slot - blk * BS) * s_cs + d,
             _to_cache(row, scale, kv_ptr.dtype.element_ty, FP8), mask=d < D)


def store_latent(
    latent: torch.Tensor,  # [T, D]: one MLA latent row per token
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, D], D contiguous
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skips
    *,
    scale: float = 1.0,  # float8 cache: this layer's latent scale
) -> None:
    num_tokens, d = latent.shape
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 1 and kv_layer.shape[3] == 1,
          "kv_layer: expected [NB, 1, BS, 1, D]")
    check(kv_layer.shape[4] == d, f"kv_layer: latent width {kv_layer.shape[4]} != {d}")
    check(latent.stride(1) == 1 and kv_layer.stride(4) == 1, "latent, kv_layer: D must be "
          "contiguous")
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_float("latent", latent)
    check_kv("kv_layer", kv_layer)
    check_int("slot_mapping", slot_mapping)
    check_device(latent, kv_layer, slot_mapping)
    if num_tokens == 0:
        return
    _store_latent_kernel[(num_tokens,)](
        latent, kv_layer, slot_mapping, latent.stride(0), kv_layer.stride(0),
        kv_layer.stride(2), float(scale), D=d, BS=kv_layer.shape[2],
        BLOCK_D=triton.next_power_of_2(d), FP8=is_fp8(kv_layer), num_warps=4,
    )
