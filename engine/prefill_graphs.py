"""CUDA graphs of the model's forward for short single-request prefill steps, one per token
bucket.

A short chunk after a cached prefix is host-bound when run eagerly: on one H200 an 8B
model's 128-token chunk after 2,048 cached tokens ran 10.6 ms of kernels in ~20.5 ms of
wall time, the rest Triton's Python launcher, F.linear and module calls, ~0.6 ms a layer
(bench/RESULTS.md, "The short cached prefill on one H200"). Replayed as one graph, the
step costs what its kernels cost.

Which steps (``bucket_for``): one request's chunk of at most ``max_tokens`` new tokens, on
any computed prefix its block table holds (up to max_model_len), whose input tokens the
host knows (none is a sample of the previous, still unread step). The chunk is padded to
the smallest bucket that holds it. Everything else runs eagerly: several requests, longer
chunks; engine/model_runner.py builds no prefill graphs for tensor-parallel followers or
MLA models (it says why).

Every input lives in one int64 device buffer (``PrefillInputs``) that the host fills with
one copy a step (engine/input_staging.PrefillStaging): token ids, positions, slot mapping,
the row of the chunk's last token and, as int32, the request's block table row, its
sequence length and cu_seqlens_q = [0, n]. Padding rows have token 0, position 0 and slot
-1 (they store no KV), and prefill attention's fixed-grid launch writes them zeros
(kernels/triton_prefill_attention.py): they touch no KV and feed nothing a real row reads.
That launch sizes its split-K grid from the block table's capacity and reads the lengths
from the buffer, so one graph serves every prefix length.

The graph ends by copying the last real row's final hidden state into ``hidden``; the
runner computes its logits and samples eagerly, as after any step, so every sampling
option (penalties, logprobs, grammars) is the eager engine's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from engine.request import PLACEHOLDER
from engine.scheduler import ScheduledChunk

log = logging.getLogger("pdserve.engine")

# The smallest bucket: a shorter chunk pads to it (a 16-row GEMM costs what a 2-row one
# does, and the prefill kernel's query tiles hold 16 rows or more).
MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Captured chunk sizes: powers of two from MIN_BUCKET below max_tokens, and
    max_tokens itself."""
    sizes = []
    s = MIN_BUCKET
    while s < max_tokens:
        sizes.append(s)
        s *= 2
    sizes.append(max_tokens)
    return sizes


def input_words(max_tokens: int, max_blocks: int) -> int:
    """int64 words of PrefillInputs.ints: ids, positions, slots [N] each, last [1], then
    table [W], seq_len [1] and cu [2] as int32 (rounded up to a whole word)."""
    return 3 * max_tokens + 1 + (max_blocks + 3 + 1) // 2


@dataclass(frozen=True)
class PrefillInputs:
    """Views of one int64 buffer (device, or the host's pinned staging of it)."""

    ints: torch.Tensor  # [input_words] int64: all below, moved by one copy
    input_ids: torch.Tensor  # [N] int64; 0 on padding rows
    positions: torch.Tensor  # [N] int64; 0 on padding rows
    slot_mapping: torch.Tensor  # [N] int64; -1 on padding rows
    last: torch.Tensor  # [1] int64: the row of the chunk's last token
    block_table: torch.Tensor  # [1, W] int32: the request's blocks (the tail is stale)
    seq_lens: torch.Tensor  # [1] int32: context length after the chunk
    cu_seqlens_q: torch.Tensor  # [2] int32: [0, n]


def prefill_inputs(ints: torch.Tensor, max_tokens: int, max_blocks: int) -> PrefillInputs:
    n, w = max_tokens, max_blocks
    assert ints.shape == (input_words(n, w),) and ints.dtype == torch.int64
    i32 = ints[3 * n + 1:].view(torch.int32)
    return PrefillInputs(ints=ints, input_ids=ints[:n], positions=ints[n:2 * n],
                         slot_mapping=ints[2 * n:3 * n], last=ints[3 * n:3 * n + 1],
                         block_table=i32[:w].view(1, w), seq_lens=i32[w:w + 1],
                         cu_seqlens_q=i32[w + 1:w + 3])


class PrefillGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_tokens: int,
                 max_blocks: int, device: torch.device, use_graphs: bool = True) -> None:
        """use_graphs=False runs the same padded forward through the same buffers eagerly:
        what CPU tests check staging, padding and the fixed-grid attention with (the
        engine builds prefill graphs only where it captures them)."""
        if max_tokens < 1:
            raise ValueError(f"prefill_graph_max_tokens: must be >= 1 here, got {max_tokens}")
        self.model = model
        self.kv_cache = kv_cache
        self.use_graphs = use_graphs
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        ints = torch.zeros(input_words(max_tokens, max_blocks), dtype=torch.int64,
                           device=device)
        self.buf = prefill_inputs(ints, max_tokens, max_blocks)
        # Until a step stages its rows, every row is padding (the warm-up's state).
        self.buf.slot_mapping.fill_(-1)
        self.hidden = torch.zeros(1, model.cfg.hidden_size,
                                  dtype=model.embed_tokens.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0  # device memory the captures added to the shared pool
        self.capture_s = 0.0
        self.num_replays = 0  # steps run through the buffers (graph replays on CUDA)

    def bucket_for(self, chunks: list[ScheduledChunk]) -> int | None:
        """The bucket a step replays, or None when it must run eagerly."""
        if len(chunks) != 1:
            return None
        c = chunks[0]
        r = c.request
        if c.num_tokens > self.max_tokens or len(r.block_ids) > self.max_blocks:
            return None
        np_ = r.num_prompt_tokens
        end = c.start + c.num_tokens
        # A token sampled by the previous step and not yet read exists only on the device.
        if end > np_ and PLACEHOLDER in r.output_token_ids[max(c.start - np_, 0):end - np_]:
            return None
        return next(b for b in self.buckets if b >= c.num_tokens)

    def _forward(self, bucket: int) -> None:
        b = self.buf
        meta = AttentionMetadata(slot_mapping=b.slot_mapping[:bucket],
                                 block_tables=b.block_table, cu_seqlens_q=b.cu_seqlens_q,
                                 seq_lens=b.seq_lens, decode_only=False, fixed_grid=True)
        out = self.model(b.input_ids[:bucket], b.positions[:bucket], self.kv_cache, meta)
        torch.index_select(out, 0, b.last, out=self.hidden)

    @torch.inference_mode()
    def capture(self, pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        """Captures every bucket, largest first, into ``pool`` (the decode graphs'; None: a
        new one). Each graph's output is copied into a buffer outside the pool, so graphs
        sharing it may replay in any order."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                # Compile every bucket's kernels outside capture (Triton specializes on the
                # token count; a compile inside a capture would break it). Every row is
                # padding here: no KV is written.
                for n in reversed(self.buckets):
                    self._forward(n)
                for n in reversed(self.buckets):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self._forward(n)
                    self.graphs[n] = g
        except RuntimeError as e:
            raise RuntimeError(f"prefill graphs: capturing failed ({e}); "
                               "--prefill-graph-max-tokens 0 runs prefill eagerly") from e
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
        self.capture_s = time.perf_counter() - t0
        log.info("prefill graphs: %d buckets (%s tokens) captured in %.2f s, %d MiB",
                 len(self.buckets), ", ".join(map(str, self.buckets)), self.capture_s,
                 self.pool_bytes >> 20)

    def replay(self, bucket: int) -> torch.Tensor:
        """Runs the graph of ``bucket`` on the rows the caller staged into ``buf``; returns
        the last real row's final hidden state [1, hidden]."""
        if self.use_graphs:
            self.graphs[bucket].replay()
        else:
            self._forward(bucket)
        self.num_replays += 1
        return self.hidden
