"""CUDA graphs of the model's forward for pure-decode steps, one per padded batch size.

A decode step of an 8B model is ~1,000 kernel launches; replaying a captured graph makes
that one launch, so the step costs what its kernels cost, not what Python costs to issue
them. Every input lives in a persistent device buffer the graphs were captured on (token
ids, positions, slot mapping, block tables, sequence lengths); a step writes its rows
there and replays the graph of the smallest captured size that holds the batch. Padding
rows have slot -1 (store_kv skips them) and sequence length 0 (attention writes zeros), so
they touch no request's KV.

Each size has two graphs: the forward (inputs -> final hidden states) and the head (hidden
-> logits -> greedy or temperature-only seeded draw into ``sampled``). The head runs when
every row samples simply; top-k/p, min-p, penalties, min_tokens and logprobs take the
hidden states to the eager sampler instead. Input ids whose token the previous step
sampled on the device are gathered inside the forward graph from ``sampled``.

Decode attention inside a graph sizes its split-K grid from the block table's capacity
(the graph cannot depend on this step's lengths) and each request spreads its own context
over those splits on the device.
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


# Rows of DecodeInputs.ints, in the order the host stages them (engine.input_staging).
IDS, POS, SLOT, LEN, FROM_PREV, SEED, SAMPLE_POS = range(7)
INT_ROWS = 7


@dataclass(frozen=True)
class DecodeInputs:
    """The persistent device buffers every graph reads, sized for the largest batch."""

    ints: torch.Tensor  # [INT_ROWS, N] int64: the rows below, filled by one copy
    input_ids: torch.Tensor  # [N] int64 (0 where from_prev >= 0)
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64; -1 on padding rows
    seq_lens: torch.Tensor  # [N] int64; 0 on padding rows
    from_prev: torch.Tensor  # [N] int64: row of `sampled` holding the input id, or -1
    seeds: torch.Tensor  # [N] int64
    sample_pos: torch.Tensor  # [N] int64: position of the token each row samples
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    block_tables: torch.Tensor  # [N, W] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32: 0..N, one query per row
    hidden: torch.Tensor  # [N, hidden] model output, written by the forward graph
    sampled: torch.Tensor  # [N] int64: written by the head graph, read by the next forward


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
        ints = torch.zeros(INT_ROWS, n, dtype=torch.int64, device=device)
        ints[SLOT] = -1
        ints[FROM_PREV] = -1
        self.buf = DecodeInputs(
            ints=ints, input_ids=ints[IDS], positions=ints[POS], slot_mapping=ints[SLOT],
            seq_lens=ints[LEN], from_prev=ints[FROM_PREV], seeds=ints[SEED],
            sample_pos=ints[SAMPLE_POS],
            temperature=torch.zeros(n, dtype=torch.float32, device=device),
            block_tables=torch.zeros(n, max_blocks, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
            hidden=torch.zeros(n, model.cfg.hidden_size, dtype=model.embed_tokens.weight.dtype,
                               device=device),
            sampled=torch.zeros(n, dtype=torch.int64, device=device),
        )
        sampler = model.kernels.sample_simple
        assert sampler is not None
        self._sample = sampler
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.heads: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0  # device memory the captures took (graphs' private pool)
        self.num_replays = 0
        self.num_head_replays = 0

    def _forward(self, n: int) -> None:
        b = self.buf
        meta = AttentionMetadata(slot_mapping=b.slot_mapping[:n],
                                 block_tables=b.block_tables[:n],
                                 cu_seqlens_q=b.cu_seqlens_q[:n + 1],
                                 seq_lens=b.seq_lens[:n], decode_only=True)
        fp = b.from_prev[:n]
        ids = torch.where(fp >= 0, b.sampled[fp.clamp(min=0)], b.input_ids[:n])
        out = self.model(ids, b.positions[:n], self.kv_cache, meta)
        b.hidden[:n].copy_(out)

    def _head(self, n: int) -> None:
        b = self.buf
        logits = self.model.lm_head(b.hidden[:n])  # model dtype: the sampler reads it as fp32
        self._sample(logits, b.temperature[:n], b.seeds[:n], b.sample_pos[:n],
                     out=b.sampled[:n])

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
            # Warm-up compiles every Triton kernel and sets the tile configs outside capture,
            # at every size: the fused MoE kernel's tiles (and its integer specializations)
            # change with the row count, and a compile inside a capture would break it.
            for n in reversed(self.sizes):
                self._forward(n)
            self._head(self.max_batch)
            for n in reversed(self.sizes):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self._forward(n)
                self.graphs[n] = g
                h = torch.cuda.CUDAGraph()
                with torch.cuda.graph(h, pool=pool, stream=stream):
                    self._head(n)
                self.heads[n] = h
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

    def replay_head(self, padded: int) -> torch.Tensor:
        """Samples every row of the last replay simply; returns ``sampled[:padded]``."""
        self.num_head_replays += 1
        if self.use_graphs:
            self.heads[padded].replay()
        else:
            self._head(padded)
        return self.buf.sampled[:padded]
