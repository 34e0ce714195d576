"""KV pool sizing from --gpu-memory-utilization: the pool gets what the weights (already
loaded), a step's activations and the decode graphs leave of the fraction asked for."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig

SLACK_BYTES = 256 << 20  # allocator rounding, Triton's and cuBLAS's workspaces


def activation_bytes(cfg: ModelConfig, tokens: int, sample_rows: int, elem: int) -> int:
    """Peak live activations of one step of ``tokens`` tokens: a layer's tensors at once
    (layers run one after another) plus float32 logits and the sampler's copies of them."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 4 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size
    moe = padding = 0
    if cfg.moe is not None:  # the fused MoE kernel's rows per (token, expert) pair:
        # activation [I] in the model dtype, weighted output [H] float32, ids and weights;
        # or, in a prefill's grouped-GEMM form (kernels/moe_grouped_gemm.py), at its peak
        # the gathered row [H] and gate/up [2I] in the model dtype and the row map, with
        # each expert's run padded by up to 15 rows and the total to a multiple of 16
        m = cfg.moe
        h, inter = cfg.hidden_size, m.intermediate_size
        per_pair = max(inter * elem + h * 4 + 16, (h + 2 * inter) * elem + 4)
        moe = m.top_k * per_pair + m.num_experts * 4  # router logits
        padding = (m.num_experts + 1) * 16 * per_pair
    return tokens * (per_token * elem + moe) + padding + 4 * sample_rows * cfg.vocab_size * 4


def graph_bytes(config: EngineConfig, cfg: ModelConfig, elem: int) -> int:
    """The decode graphs' private pool: captured largest first and shared, so about one
    max-batch decode step's activations, plus the head graphs' logits in the model dtype
    (the simple sampler reads them in place; other sampling runs outside the graphs)."""
    if config.enforce_eager:
        return 0
    logits = config.max_num_seqs * cfg.vocab_size * elem
    return activation_bytes(cfg, config.max_num_seqs, 0, elem) + logits


def kv_bytes_for_utilization(config: EngineConfig, cfg: ModelConfig,
                             device: torch.device) -> int:
    """Bytes for the KV pool; ValueError naming the flag when nothing is left for it."""
    assert config.gpu_memory_utilization is not None
    elem = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(config.gpu_memory_utilization * total) - (total - free)
    act = activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs, elem)
    need = act + graph_bytes(config, cfg, elem) + SLACK_BYTES
    if budget - need <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} of "
            f"{total >> 20} MiB leaves {max(budget, 0) >> 20} MiB after what is in use "
            f"(weights), short of the {need >> 20} MiB activations and graphs need "
            "before any KV cache")
    return budget - need
