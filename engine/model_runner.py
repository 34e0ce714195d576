"""Turns a scheduled batch into tensors, runs the model and samples, all without a host sync.

Placeholder inputs (tokens sampled by the previous, still unread step) are filled on the
device from that step's sampled-id tensor, which is what lets output be deferred.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.decode_graphs import DecodeGraphs
from engine.dp_runner import execute_dp
from engine.grammar.masks import GrammarMasks
from engine.inflight_step import InflightStep
from engine.input_staging import DecodeStaging, PrefillStaging
from engine.kv_scales import kv_scales_of
from engine.models.llama import LlamaForCausalLM
from engine.parallel.dp_groups import DPLayout
from engine.parallel.followers import TPFollowers
from engine.parallel.graph_step import GraphStep
from engine.parallel.step_plan import StepPlan, run_plan
from engine.penalty_state import PenaltyState
from engine.prefill_graphs import PrefillGraphs
from engine.request import PLACEHOLDER, Request
from engine.sampler import SamplerOutput, SamplingBatch, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk


def _plain(p: SamplingParams) -> bool:
    """Greedy or temperature alone: what the simple sampler (and the graphs' head) draws."""
    return (p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 and p.logprobs is None
            and p.repetition_penalty == 1 and not p.frequency_penalty
            and not p.presence_penalty and p.structured is None)


def _prev_reader(prev: InflightStep | None,
                 prev_rows: dict[int, int]) -> Callable[[Request], int] | None:
    """Reads a request's token from the previous step's host copy (waiting for that step
    alone, once: the whole row becomes one list), for grammars that must advance past it
    before masking this step."""
    if prev is None:
        return None
    ids: list[int] = []

    def read(r: Request) -> int:
        if not ids:
            ids.extend(prev.out.token_ids.tolist())
        return ids[prev_rows[id(r)]]
    return read


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 eos_token_ids: frozenset[int], device: torch.device, *,
                 max_num_seqs: int = 0, max_model_len: int = 0,
                 cuda_graphs: bool = False, followers: TPFollowers | None = None,
                 prefill_graph_max_tokens: int = 0) -> None:
        """cuda_graphs: capture pure-decode steps up to max_num_seqs requests of at most
        max_model_len tokens (CUDA only), and one request's prefill chunks of at most
        prefill_graph_max_tokens tokens (0: none); other steps, and every step without,
        run eagerly."""
        self.model = model
        self.kv_cache = kv_cache  # [NB, L, 2, BS, Hkv, D]
        self.block_size = block_size
        self.eos = sorted(eos_token_ids)
        self.device = device
        self.vocab = model.cfg.vocab_size
        # Tensor parallel (rank 0): every step's plan goes to the followers first, and the
        # sampled ids after; they run the same forward with their shards.
        self.followers = followers
        if self.followers is not None:
            self.followers.start_kv(tuple(kv_cache.shape), kv_cache.dtype,
                                    kv_scales_of(model) if kv_cache.dtype == torch.float8_e4m3fn
                                    else ())
            self.followers.bind_pool(kv_cache, model.group)  # latent copies (block_copy.py)
        # Pure-decode steps read persistent buffers, replayed as CUDA graphs where allowed.
        # Under TP every follower holds the same buffers and graphs (engine.parallel.
        # graph_step): they capture at the same time, so the warm-up's collectives pair up.
        self.graphs: DecodeGraphs | None = None
        # data-parallel attention: each group runs its own plan (engine/dp_runner.py); its
        # steps run eagerly
        ep = model.ep_group
        self.dp_layout = (DPLayout(ep.size, ep.size // model.shard.size)
                          if ep is not None else None)
        if self.dp_layout is not None and self.followers is not None \
                and device.type == "cuda":
            self.followers.watch()  # an idle group's rank may wait on a dead one: end it now
        if max_num_seqs and max_model_len and self.dp_layout is None:
            max_blocks = -(-max_model_len // block_size)
            use = cuda_graphs and device.type == "cuda" and model.kernels.graph_safe
            self.graphs = DecodeGraphs(model, kv_cache, max_num_seqs, max_blocks, device,
                                       use_graphs=use)
            self.staging = DecodeStaging(self.graphs.max_batch, max_blocks, device)
            if self.followers is not None:
                self.followers.start_graphs(max_num_seqs, max_blocks, use)
            try:
                self.graphs.capture()
            except (RuntimeError, OSError) as e:
                if self.followers is not None:
                    raise self.followers.failure(e) from e
                raise
            if self.followers is not None:
                self.followers.graphs_ready(captured=use)
        self.prefill_graphs: PrefillGraphs | None = None
        # Not under tensor parallelism: followers replay only what a typed step message
        # names, and a prefill graph step would need its own message and a capture on
        # every rank. Not for MLA: its prefill, without host lengths, decompresses every
        # block the table names (engine/models/mla.py), here the whole max_model_len.
        if (prefill_graph_max_tokens and self.graphs is not None and self.graphs.use_graphs
                and self.followers is None and not model.cfg.is_mla):
            self.enable_prefill_graphs(min(prefill_graph_max_tokens, max_model_len),
                                       self.graphs.max_blocks)
        self.penalties = PenaltyState(self.vocab, device)
        self.grammar_masks = GrammarMasks(self.vocab, self.eos, device)
        # the step output whose ids are in graphs.buf.sampled (None: nobody's)
        self._sampled_holds: SamplerOutput | None = None

    def enable_prefill_graphs(self, max_tokens: int, max_blocks: int,
                              use_graphs: bool = True) -> None:
        """Runs one request's prefill chunks of at most max_tokens tokens and max_blocks
        blocks through persistent buffers: replayed as CUDA graphs, captured now into the
        decode graphs' pool, or with use_graphs False the same padded forward run eagerly
        (CPU tests)."""
        self.prefill_graphs = PrefillGraphs(self.model, self.kv_cache, max_tokens, max_blocks,
                                            self.device, use_graphs=use_graphs)
        self.prefill_staging = PrefillStaging(max_tokens, max_blocks, self.block_size,
                                              self.device)
        decode = self.graphs.graphs if self.graphs is not None else {}
        self.prefill_graphs.capture(next(iter(decode.values())).pool() if decode else None)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk],
                prev: InflightStep | None) -> tuple[list[Request], SamplerOutput]:
        if self.followers is None:
            samplers, out = self._execute(chunks, prev)
        else:
            try:
                samplers, out = self._execute(chunks, prev)
            except (RuntimeError, OSError) as e:
                raise self.followers.failure(e) from e
        out.start_host_copy()  # reading it later waits for this step only
        if samplers:  # grammars: next step's masks start once these ids exist
            self.grammar_masks.ahead(samplers, out.device_token_ids)
        return samplers, out

    def close(self) -> None:
        """Stops the follower ranks (tensor parallel) and the grammar mask thread."""
        self.grammar_masks.close()
        if self.followers is not None:
            self.followers.close()

    def _execute(self, chunks: list[ScheduledChunk],
                 prev: InflightStep | None) -> tuple[list[Request], SamplerOutput]:
        if self.dp_layout is not None:
            return execute_dp(self, self.dp_layout, chunks, prev)
        if (self.graphs is not None and len(chunks) <= self.graphs.max_batch
                and all(c.num_tokens == 1 for c in chunks)
                and max(len(c.request.block_ids) for c in chunks) <= self.graphs.max_blocks):
            return self._execute_graph(chunks, prev)
        if self.prefill_graphs is not None:
            bucket = self.prefill_graphs.bucket_for(chunks)
            if bucket is not None:
                return self._execute_prefill_graph(chunks[0], bucket, prev)
        prev_rows = {id(r): i for i, r in enumerate(prev.requests)} if prev else {}
        plan, samplers = self._plan(chunks, prev_rows)
        if self.followers is not None:
            self.followers.send(plan)
        logits = run_plan(self.model, self.kv_cache, plan,
                          prev.out.device_token_ids if prev else None, self.device)
        if logits is None:
            return samplers, SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64))
        out = self._sample(logits, self._sampling_batch(samplers, prev, prev_rows))
        if self.followers is not None:  # their next step may read these as inputs
            self.followers.group.broadcast(out.device_token_ids, 0)
        return samplers, out

    def _plan(self, chunks: list[ScheduledChunk],
              prev_rows: dict[int, int]) -> tuple[StepPlan, list[Request]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        fix_at: list[int] = []  # flat indices whose input is the previous step's sample
        fix_from: list[int] = []  # ... and the row of prev.out they take
        cu = [0]
        seq_lens: list[int] = []
        sample_at: list[int] = []
        samplers: list[Request] = []
        for c in chunks:
            r = c.request
            start, end = c.start, c.start + c.num_tokens
            if c.num_tokens == 1:  # a decode row: the slicing below costs it more
                tok = r.token_at(start)
                if tok == PLACEHOLDER:
                    fix_at.append(len(ids))
                    fix_from.append(prev_rows[id(r)])
                    tok = 0
                ids.append(tok)
                pos.append(start)
                slots.append(r.block_ids[start // bs] * bs + start % bs)
            else:  # by slices and ranges, not per token (a third of the time at 4,096 tokens)
                base = len(ids)
                n = len(r.prompt_token_ids)
                toks = r.prompt_token_ids[start:min(end, n)]
                if end > n:  # outputs in the chunk (a prefill after preemption)
                    toks = toks + r.output_token_ids[max(start - n, 0):end - n]
                    if PLACEHOLDER in toks:  # the previous step's sample, not yet read back
                        for j, tok in enumerate(toks):
                            if tok == PLACEHOLDER:
                                fix_at.append(base + j)
                                fix_from.append(prev_rows[id(r)])
                                toks[j] = 0
                ids.extend(toks)
                pos.extend(range(start, end))
                p = start
                while p < end:  # one run of slots per block the chunk touches
                    off = p % bs
                    run = min(end - p, bs - off)
                    first = r.block_ids[p // bs] * bs + off
                    slots.extend(range(first, first + run))
                    p += run
            cu.append(len(ids))
            seq_lens.append(end)
            if c.samples:
                sample_at.append(len(ids) - 1)
                samplers.append(r)
        max_blocks = max(len(c.request.block_ids) for c in chunks)
        tables = [c.request.block_ids + [0] * (max_blocks - len(c.request.block_ids))
                  for c in chunks]
        return StepPlan(ids, pos, slots, cu, seq_lens, tables, sample_at, fix_at,
                        fix_from), samplers

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return sample(logits, batch, simple=self.model.kernels.sample_simple)

    def _execute_graph(self, chunks: list[ScheduledChunk],
                       prev: InflightStep | None) -> tuple[list[Request], SamplerOutput]:
        """A pure-decode step: one loop over requests (not tokens) fills pinned staging, one
        copy moves it, the graphs replay; nothing here waits for the device."""
        assert self.graphs is not None
        g, bs = self.graphs, self.block_size
        b = len(chunks)
        n = g.size_for(b)
        assert n is not None
        st, temps = self.staging.begin()
        prev_rows = {id(r): i for i, r in enumerate(prev.requests)} if prev else {}
        any_prev = False
        simple = True  # every row samples greedily or with temperature alone
        samplers: list[Request] = []
        sample_rows: list[int] = []
        for i, c in enumerate(chunks):
            r, p = c.request, c.start
            tok = r.token_at(p)
            st[4, i] = -1
            if tok == PLACEHOLDER:
                st[4, i] = prev_rows[id(r)]
                any_prev = True
                tok = 0
            st[0, i] = tok
            st[1, i] = p
            st[2, i] = r.block_ids[p // bs] * bs + p % bs
            st[3, i] = p + 1
            st[5, i] = r.seed
            st[6, i] = r.num_tokens
            sp = r.params
            temps[i] = 0.0 if sp.greedy else sp.temperature
            self.staging.table_row(i, r.block_ids)
            if c.samples:
                samplers.append(r)
                sample_rows.append(i)
                simple = simple and _plain(sp) and len(r.output_token_ids) >= sp.min_tokens
        st[:, b:n] = 0
        st[2, b:n] = -1  # padding rows write no KV; length 0 makes their attention empty
        st[4, b:n] = -1
        temps[b:n] = 0.0
        buf = g.buf
        head = bool(samplers) and simple and len(sample_rows) == b
        copy_prev = 0
        if any_prev and self._sampled_holds is not (prev.out if prev else None):
            assert prev is not None  # its ids are not in buf.sampled: put them there
            copy_prev = prev.out.device_token_ids.shape[0]
        if self.followers is not None:
            at, to = self.staging.pending_edits()
            self.followers.send(GraphStep(
                padded=n, ints=st[:, :n].copy(), temps=temps[:n].copy(), edit_at=at,
                edit_to=to, copy_prev=copy_prev, head=head,
                logit_rows=None if len(sample_rows) == b else sample_rows, batch=b,
                samples=bool(samplers)))
        self.staging.upload(buf.ints, buf.temperature, buf.block_tables)
        if copy_prev:
            assert prev is not None
            buf.sampled[:copy_prev].copy_(prev.out.device_token_ids)
        hidden = g.replay(n)
        if not samplers:
            return samplers, SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64))
        if head:
            ids = g.replay_head(n)[:b]
            out = SamplerOutput(ids if ids.is_cuda else ids.clone())
            # On CUDA the view stays valid for what reads it: the host copy queued next,
            # and the next step, which reads it before its own head overwrites it.
            self._sampled_holds = out
            return samplers, out
        rows = hidden[:b] if len(sample_rows) == b else \
            hidden[self._tensor(sample_rows, torch.int64)]
        logits = self.model.compute_logits(rows)
        out = self._sample(logits, self._sampling_batch(samplers, prev, prev_rows))
        if self.followers is not None:  # their next step may read these as inputs
            self.followers.group.broadcast(out.device_token_ids, 0)
        return samplers, out

    def _execute_prefill_graph(self, c: ScheduledChunk, bucket: int, prev: InflightStep | None
                               ) -> tuple[list[Request], SamplerOutput]:
        """One request's short chunk (engine/prefill_graphs.py): one copy stages it, a graph
        replays it, and its last row's logits are sampled eagerly as any step's are."""
        assert self.prefill_graphs is not None
        self.prefill_staging.stage(c.request, c.start, c.num_tokens, bucket)
        self.prefill_staging.upload(self.prefill_graphs.buf.ints)
        hidden = self.prefill_graphs.replay(bucket)
        if not c.samples:
            return [], SamplerOutput(token_ids=torch.empty(0, dtype=torch.int64))
        samplers = [c.request]
        prev_rows = {id(r): i for i, r in enumerate(prev.requests)} if prev else {}
        logits = self.model.compute_logits(hidden)
        return samplers, self._sample(logits, self._sampling_batch(samplers, prev, prev_rows))

    def _sampling_batch(self, reqs: list[Request], prev: InflightStep | None,
                        prev_rows: dict[int, int]) -> SamplingBatch:
        ps = [r.params for r in reqs]
        # two copies, not six: every per-row float in one tensor, every int in another
        floats = self._tensor([[p.temperature if not p.greedy else 0.0 for p in ps],
                               [p.top_p for p in ps], [p.min_p for p in ps]], torch.float32)
        ints = self._tensor([[max(p.top_k, 0) for p in ps], [r.seed for r in reqs],
                             [r.num_tokens for r in reqs]], torch.int64)
        b = SamplingBatch(
            temperature=floats[0], top_k=ints[0], top_p=floats[1], min_p=floats[2],
            seeds=ints[1], positions=ints[2],
            all_greedy=all(p.greedy for p in ps),
            any_top_k=any(p.top_k > 0 for p in ps),
            max_top_k=max(max(p.top_k, 0) for p in ps),
            any_top_p=any(p.top_p < 1 for p in ps),
            any_min_p=any(p.min_p > 0 for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )
        under = [(i, r) for i, r in enumerate(reqs)
                 if len(r.output_token_ids) < r.params.min_tokens]
        if under:  # the mask is made on the device; only (row, id) pairs cross
            pairs = [(i, t) for i, r in under for t in self.eos + r.params.stop_token_ids]
            b.banned = torch.zeros(len(reqs), self.vocab, dtype=torch.bool, device=self.device)
            if pairs:
                at = self._tensor(pairs, torch.int64)
                b.banned[at[:, 0], at[:, 1]] = True
        if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
               for p in ps):
            self._penalty_state(b, reqs, prev, prev_rows)
        # Called after the forward was launched: rows the ahead job did not cover (all of them
        # on a CPU) advance and fill while the device works.
        b.allowed = self.grammar_masks.bitmask(reqs, _prev_reader(prev, prev_rows))
        return b

    def _penalty_state(self, b: SamplingBatch, reqs: list[Request], prev: InflightStep | None,
                       prev_rows: dict[int, int]) -> None:
        prev_ids = prev.out.device_token_ids if prev else None
        b.output_counts, b.seen_mask = self.penalties.tensors(reqs, prev_ids, prev_rows)
        b.repetition = self._tensor([r.params.repetition_penalty for r in reqs], torch.float32)
        b.frequency = self._tensor([r.params.frequency_penalty for r in reqs], torch.float32)
        b.presence = self._tensor([r.params.presence_penalty for r in reqs], torch.float32)
