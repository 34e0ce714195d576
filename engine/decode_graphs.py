"""CUDA graphs of the model's forward for pure-decode steps, one per padded batch size.

A decode step of an 8B model is ~1,000 kernel launches; replaying a captured graph makes
that one launch, so the step costs what its kernels cost, not what Python costs to issue
them. Every input lives in a persistent device buffer the graphs were captured on (token
ids, positions, slot mapping, block tables, sequence lengths); a step writes its rows
there and replays the graph of the smallest captured size that holds the batch. Padding
rows have slot -1 (store_kv skips them) and sequence length 0 (attention writes zeros), so
they touch no request's KV. Sampling stays eager: its work depends on which features the
batch uses, and it is a handful of kernels on [B, vocab] logits.

Decode attention inside a graph sizes its split-K grid from the block table's capacity
(the graph cannot depend on this step's lengths); empty splits exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM


def batch_ladder(max_batch: int) -> list[int]:
    """Captured sizes: 1, 2, 4, 8, then every 8 up to max_batch (which is always in)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    sizes.append(max_batch)
    return sorted(set(sizes))


@dataclass(frozen=True)
class DecodeInputs:
    """The persistent device buffers every graph reads, sized for the largest batch."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64; -1 on padding rows
    block_tables: torch.Tensor  # [N, W] int32
    seq_lens: torch.Tensor  # [N] int32; 0 on padding rows
    cu_seqlens_q: torch.Tensor  # [N + 1] int32: 0..N, one query per row
    hidden: torch.Tensor  # [N, hidden] model output, written by the graph


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks: int, device: torch.device, use_graphs: bool = True) -> None:
        """use_graphs=False (CPU, --enforce-eager): the same buffers, run eagerly, unpadded."""
        self.model = model
        self.kv_cache = kv_cache
        self.use_graphs = use_graphs
        self.sizes = batch_ladder(max_batch) if use_graphs else [max_batch]
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        n = self.max_batch
        i64 = torch.int64
        self.buf = DecodeInputs(
            input_ids=torch.zeros(n, dtype=i64, device=device),
            positions=torch.zeros(n, dtype=i64, device=device),
            slot_mapping=torch.full((n,), -1, dtype=i64, device=device),
            block_tables=torch.zeros(n, max_blocks, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
            hidden=torch.zeros(n, model.cfg.hidden_size, dtype=model.embed_tokens.weight.dtype,
                               device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0  # device memory the captures took (graphs' private pool)
        self.num_replays = 0

    def _forward(self, n: int) -> None:
        b = self.buf
        meta = AttentionMetadata(slot_mapping=b.slot_mapping[:n],
                                 block_tables=b.block_tables[:n],
                                 cu_seqlens_q=b.cu_seqlens_q[:n + 1],
                                 seq_lens=b.seq_lens[:n], decode_only=True)
        out = self.model(b.input_ids[:n], b.positions[:n], self.kv_cache, meta)
        b.hidden[:n].copy_(out)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first so the smaller ones reuse its pool."""
        if not self.use_graphs:
            return
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Warm-up compiles every Triton kernel and sets the tile configs outside capture.
            self._forward(self.max_batch)
            for n in reversed(self.sizes):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._forward(n)
                self.graphs[n] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size >= batch; None when the batch is larger than all."""
        if not self.use_graphs:
            return batch if batch <= self.max_batch else None
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def replay(self, padded: int) -> torch.Tensor:
        """Runs the graph of a captured size whose ``padded`` rows the caller wrote into
        ``buf`` (padding rows: slot -1, length 0); returns [padded, hidden]."""
        if self.use_graphs:
            self.graphs[padded].replay()
            self.num_replays += 1
        else:
            self._forward(padded)
        return self.buf.hidden[:padded]
