"""An engine's KV pool: its layout (what a token stores, in which dtype, with which float8
scales), how many blocks it gets, and the tensor itself."""

from __future__ import annotations

import dataclasses

import torch

from engine import host_memory
from engine.config import EngineConfig, ModelConfig
from engine.kv_layout import KVLayout, kv_shape_of


def build_kv_pool(config: EngineConfig, model_cfg: ModelConfig, identity: str,
                  kv_scales: tuple[float, ...], max_model_len: int
                  ) -> tuple[KVLayout, torch.Tensor]:
    """Rank 0's layout and pool [NB, L, planes, BS, heads, D] in the KV dtype (a float8 pool
    holds twice the blocks of a bf16 one in the same bytes)."""
    device = torch.device(config.device)
    layout = KVLayout(
        model=identity, dtype=config.kv_dtype, block_size=config.block_size,
        num_layers=model_cfg.num_layers, **kv_shape_of(model_cfg), num_blocks=1,
        # rank 0's pool: its own heads (model.shard; MLA: the latent, whole on every rank);
        # under data-parallel attention its group's split (engine/parallel/dp_groups.py)
        tp_size=config.tensor_parallel_size // config.data_parallel_size, tp_rank=0,
        kv_scales=kv_scales)
    # Never more than every seat filled to max_model_len could use.
    cap = config.max_num_seqs * -(-max_model_len // config.block_size)
    kv_bytes = config.kv_cache_bytes
    if config.gpu_memory_utilization is not None:
        from engine.memory_budget import kv_bytes_for_utilization

        kv_bytes = kv_bytes_for_utilization(config, model_cfg, device)
    num_blocks = config.num_kv_blocks or max(1, min(cap, kv_bytes // layout.block_nbytes))
    layout = dataclasses.replace(layout, num_blocks=num_blocks)
    dtype = getattr(torch, config.kv_dtype)
    shape = (num_blocks, *layout.block_shape)
    # on CPU, huge pages: a transfer between processes pins every page it moves
    pool = (host_memory.zeros(shape, dtype) if device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device))
    return layout, pool
