"""Plain-torch references for KV movement: store into paged blocks, gather/scatter blocks.

KV layout (block-major): the engine's cache is one tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a layer's view
``kv_cache[:, layer]`` is ``kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]``
(strided: one block holds every layer, so blocks are far apart in a layer view).
A float8 cache stores ``x / scale`` (kernels/kv_fp8.py); scales are ignored otherwise.
"""

from __future__ import annotations

import torch

from kernels.kv_fp8 import as_bytes, put, to_cache


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [NB, 2, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * BS + offset; < 0 means skip
    *,
    k_scale: float = 1.0,  # float8 cache: this layer's K scale
    v_scale: float = 1.0,
) -> None:
    block_size = kv_layer.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    put(kv_layer, (blocks, 0, offsets), to_cache(key[keep], kv_layer.dtype, k_scale))
    put(kv_layer, (blocks, 1, offsets), to_cache(value[keep], kv_layer.dtype, v_scale))


def gather_blocks_ref(
    cache: torch.Tensor,  # [NB, *block_shape]: any layout whose dim 0 is the block
    block_ids: torch.Tensor,  # [N] int64
    out: torch.Tensor | None = None,  # [N, *block_shape], contiguous
) -> torch.Tensor:
    if out is None:
        out = torch.empty((block_ids.numel(), *cache.shape[1:]), dtype=cache.dtype,
                          device=cache.device)
    torch.index_select(as_bytes(cache), 0, block_ids, out=as_bytes(out))
    return out


def scatter_blocks_ref(
    src: torch.Tensor,  # [N, *block_shape]
    cache: torch.Tensor,  # [NB, *block_shape]
    block_ids: torch.Tensor,  # [N] int64
) -> None:
    as_bytes(cache).index_copy_(0, block_ids, as_bytes(src))


def store_latent_ref(
    latent: torch.Tensor,  # [T, D]: one MLA latent row per token (kv_lora_rank + rope)
    kv_layer: torch.Tensor,  # [NB, 1, BS, 1, D]
    slot_mapping: torch.Tensor,  # [T] int64, slot = block * BS + offset; < 0 means skip
    *,
    scale: float = 1.0,  # float8 cache: this layer's latent scale
) -> None:
    block_size = kv_layer.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    put(kv_layer, (blocks, 0, offsets, 0), to_cache(latent[keep], kv_layer.dtype, scale))
