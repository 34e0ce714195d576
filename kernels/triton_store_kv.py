"""Triton ``store_kv`` and ``store_latent``: write the step's new K/V rows (or MLA latent
rows) into paged blocks (see ref_kv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check, check_device, check_float, check_int, check_shape


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, kv_ptr, slot_ptr,
    s_kt, s_kh, s_kd,  # key strides
    s_vt, s_vh, s_vd,  # value strides
    s_cb, s_ckv, s_cs, s_ch, s_cd,  # kv_layer strides [NB, 2, BS, Hkv, D]
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(dst, k.to(ty), mask=mask)
    tl.store(dst + s_ckv, v.to(ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D], any strides
    slot_mapping: torch.Tensor,  # [T] int32/int64, slot = block * BS + offset; < 0 skips
) -> None:
    num_tokens, hkv, d = key.shape
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: expected [NB, 2, BS, Hkv, D]")
    check_shape("value", value, key.shape)
    check_shape("kv_layer[0, 0, 0]", kv_layer[0, 0, 0], (hkv, d))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    for name, t in (("key", key), ("value", value), ("kv_layer", kv_layer)):
        check_float(name, t)
    check_int("slot_mapping", slot_mapping)
    check_device(key, value, kv_layer, slot_mapping)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_layer, slot_mapping,
        *key.stride(), *value.stride(), *kv_layer.stride(),
        HKV=hkv, D=d, BS=kv_layer.shape[2],
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )


@triton.jit
def _store_latent_kernel(
    src_ptr, kv_ptr, slot_ptr,
    s_t,  # latent row stride; D is contiguous
    s_cb, s_cs,  # kv_layer strides of the block and the token [NB, 1, BS, 1, D]
    D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (a graph's padding row): nothing to write
        return
    blk = slot // BS
    d = tl.arange(0, BLOCK_D)
    row = tl.load(src_ptr + t * s_t + d, mask=d < D)
    tl.store(kv_ptr + blk * s_cb + (slot - blk * BS) * s_cs + d,
             row.to(kv_ptr.dtype.element_ty), mask=d < D)


def store_latent(
    latent: torch.Tensor,  # [T, D]: one MLA latent row per token
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, D], D contiguous
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 skips
) -> None:
    num_tokens, d = latent.shape
    check(kv_layer.dim() == 5 and kv_layer.shape[1] == 1 and kv_layer.shape[3] == 1,
          "kv_layer: expected [NB, 1, BS, 1, D]")
    check(kv_layer.shape[4] == d, f"kv_layer: latent width {kv_layer.shape[4]} != {d}")
    check(latent.stride(1) == 1 and kv_layer.stride(4) == 1, "latent, kv_layer: D must be "
          "contiguous")
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_float("latent", latent)
    check_float("kv_layer", kv_layer)
    check_int("slot_mapping", slot_mapping)
    check_device(latent, kv_layer, slot_mapping)
    if num_tokens == 0:
        return
    _store_latent_kernel[(num_tokens,)](
        latent, kv_layer, slot_mapping, latent.stride(0), kv_layer.stride(0),
        kv_layer.stride(2), D=d, BS=kv_layer.shape[2], BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
