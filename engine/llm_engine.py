"""The engine loop: schedule -> execute -> update, in direct or deferred output mode.

Deferred (consumer, colocated): step N+1 is launched before step N's sampled ids are read;
N's stop checks and streaming happen after, and a token sampled past a stop is dropped.
Direct (producer): a step's sampled ids are read and reported by that same step, so token 0
never waits behind another request's prefill chunk (docs/architecture.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockAccounting, BlockManager
from engine.config import EngineConfig, ModelConfig, resolve_max_model_len
from engine.dp_scheduler import make_scheduler
from engine.grammar.factory import GrammarFactory
from engine.inflight_step import InflightStep
from engine.kv_pool import build_kv_pool
from engine.kv_scales import apply_kv_scales, kv_scales_for
from engine.models.llama import LlamaForCausalLM
from engine.outputs import HeldRequest, RequestOutput, StepResult, logprob_rows
from engine.prefix_cache import PrefixCache
from engine.prefix_queries import PrefixCacheQueries
from engine.request import PLACEHOLDER, LogprobRow, Request
from engine.request_intake import check_new, check_prior, resume_after
from engine.request_state import RequestState
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sim_runner import SimRunner, make_runner
from engine.step_timing import StepTiming
from engine.stop_check import check_stop, streamable_len

if TYPE_CHECKING:
    from engine.parallel.followers import TPFollowers
    from engine.tokenizer import Tokenizer

TraceHook = Callable[[str, int], None]


class LLMEngine(PrefixCacheQueries):
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig,
                 model: LlamaForCausalLM | None, tokenizer: Tokenizer | None, model_name: str,
                 model_identity: str | None = None,
                 kv_scales: tuple[float, ...] | None = None,
                 followers: TPFollowers | None = None) -> None:
        """model_name: what the model is called (registration, logs); model_identity: what
        the KV fingerprint compares (engine/model_identity.py; default: the name);
        kv_scales: a float8 pool's per-layer K and V scales (engine/kv_scales.py; None:
        1.0 each), handed to the model's attention here; followers: a TP engine's other
        ranks, which its runner drives (engine.llm.build_engine). model is None only for a
        simulated engine (config.simulate)."""
        self.config = config
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = torch.device(config.device)
        self.max_model_len = resolve_max_model_len(config, model_cfg)
        if kv_scales is None:
            kv_scales = kv_scales_for(config, model_cfg, None)
        if model is not None:
            apply_kv_scales(model, kv_scales)
        self.layout, self.kv_cache = build_kv_pool(config, model_cfg,
                                                   model_identity or model_name, kv_scales,
                                                   self.max_model_len)
        assert model is None or model_cfg.is_mla \
            or self.layout.head_count == model.shard.num_kv_heads, \
            "TP head split differs"
        num_blocks = self.layout.num_blocks
        # A sequence can never outgrow the pool: advertise what really fits.
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size,
                                   PrefixCache() if config.enable_prefix_caching else None)
        self.prefix_model_key = self.layout.fingerprint()
        self.scheduler = make_scheduler(config, self.blocks, self.max_model_len)
        eos = set(model_cfg.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self.runner = make_runner(config, model, self.kv_cache, self.eos_token_ids, self.device,
                                  self.max_model_len, tokenizer, model_cfg.vocab_size,
                                  followers)
        self.grammars = GrammarFactory(tokenizer, model_cfg.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._inflight: InflightStep | None = None
        # launched steps not read yet -> the requests they write, and blocks to free once
        # each has been read
        # (and how far each request's KV is written once it has been read: prefix caching
        # registers only blocks whose KV is fully written)
        self._unread: dict[int, dict[str, tuple[Request, int]]] = {}
        self._free_after: dict[int, list[tuple[BlockManager, list[int]]]] = {}
        self._step_id = 0
        self._seed_rng = random.Random(config.seed)
        self.num_preemptions = 0  # requests whose KV was dropped to be recomputed
        self.trace: TraceHook | None = None  # ("launch" | "read", step id), for tests/metrics
        # Wall-clock marks of the last step() call, for a caller that paces its launches
        # (worker/launch_pacer.py): when it was entered and its step launched (0: none was),
        # and when the step it read was launched and read (0: none was).
        self.timing = StepTiming()
        # Called over and over while a step that is read at once (a producer's: the engine
        # does not defer) still runs on the device, in place of blocking in the read, with
        # the seconds left when known (0: not): the worker's loop takes the router's
        # commands meanwhile (WorkerLoop.during_step). It must not add requests or change
        # this step's.
        self.device_wait: Callable[[float], None] | None = None
        # ... and between the decoder layers of a step's eager forward, whose host launches
        # take longer than its kernels (bench/RESULTS.md, "The short cached prefill on one
        # H200"): the same commands, taken without waiting. Set (by the worker) only where
        # device_wait is, for the model's forward during step() alone.
        self.between_launches: Callable[[], None] | None = None
        # Called with a step's outputs right after they are read back, when the step is read
        # at once (a producer's), ahead of the step's result and the worker loop's own
        # bookkeeping: a producer sends its token 0s from here, since the client's first
        # token waits for the last of a step's 16 or so (bench/RESULTS.md, sessions 43-44).
        self.on_read: Callable[[list[RequestOutput]], None] | None = None

    @property
    def defers_output(self) -> bool:
        return self.config.defers_output

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_new(prompt_token_ids, params, self.model_cfg.vocab_size, self.max_model_len,
                  self.blocks)

    def validate_prior(self, prompt_token_ids: list[int], params: SamplingParams,
                       prior_output_ids: list[int]) -> None:
        check_prior(prompt_token_ids, params, prior_output_ids, self.model_cfg.vocab_size,
                    self.max_model_len)

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, state: RequestState,
                     prior_output_ids: list[int] | None = None,
                     cache_salt: str | None = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt: must be a string, got {type(cache_salt).__name__}")
        prior = list(prior_output_ids or ())
        if prior:
            self.validate_prior(prompt_token_ids, params, prior)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(request_id, list(prompt_token_ids), params, seed, state=state,
                      prefill_only=self.config.prefills_only,
                      cache_root=self.chain_root(cache_salt),
                      grammar=self.grammars.for_params(params))  # ValueError: no compile
        if self.tokenizer is not None:
            from engine.detokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens)
        if prior:
            resume_after(req, prior)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prior_output_ids: list[int] | None = None,
                    cache_salt: str | None = None, dp_rank: int | None = None) -> Request:
        """Queues a request (QUEUED); ValueError names a bad field, QueueFull means retry
        later.

        cache_salt: only requests of one salt (e.g. a tenant) share cached prefix blocks.

        prior_output_ids: a migrated request's tokens its client already has; they are
        prefilled with the prompt and generation goes on after them as if it never stopped
        (same positions, penalties, min/max_tokens and stop state).
        dp_rank: the attention data-parallel group to serve it (None: the least loaded)."""
        req = self._new_request(request_id, prompt_token_ids, params, RequestState.QUEUED,
                                prior_output_ids, cache_salt)
        self.scheduler.place(req, dp_rank)
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def add_remote(self, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, prior_output_ids: list[int] | None = None,
                   cache_salt: str | None = None, reuse_cached: bool = False,
                   dp_rank: int | None = None) -> None:
        """Consumer: a request whose prompt KV and token 0 come from a producer (RESERVING).
        The scheduler gives it blocks when the pool and a seat allow; step() reports them
        in ``reserved`` (WAITING_FOR_KV), then kv_landed() lets it decode. A migrated
        request's prior_output_ids come with the KV too (blocks for prompt + prior).
        reuse_cached: may reserve cached blocks the sender must skip (prefix_queries.py).
        dp_rank: the attention data-parallel group whose pool takes the KV (None: the
        least loaded)."""
        req = self._new_request(request_id, prompt_token_ids, params, RequestState.RESERVING,
                                prior_output_ids, cache_salt)
        req.reuse_cached = reuse_cached
        self.scheduler.place(req, dp_rank)
        self.scheduler.add_remote(req)
        self.requests[request_id] = req

    def kv_landed(self, request_id: str, first_token: int,
                  first_logprob: LogprobRow | None = None) -> None:
        """Consumer: the prompt's KV sits in the reserved blocks and token 0 was sampled (and
        reported) by the producer; decoding continues exactly as a colocated engine would
        (same seed, same positions, same stop state). With logprobs requested, token 0's row
        is needed: rows are kept by output position."""
        req = self.requests[request_id]
        if req.state != RequestState.WAITING_FOR_KV:
            raise ValueError(f"request_id: {request_id!r} is {req.state.name}, not "
                             "WAITING_FOR_KV")
        self._land(req, first_token, first_logprob)
        self.scheduler.cache_written(req, req.num_tokens)  # the transfer is done
        self.scheduler.kv_landed(req)

    def _land(self, req: Request, first_token: int, first_logprob: LogprobRow | None) -> None:
        if req.params.logprobs is not None and first_logprob is None:
            raise ValueError("first_logprob: token 0's logprobs are required when the request "
                             "asks for logprobs")
        req.num_computed_tokens = req.num_tokens  # prompt (+ a migrated request's prior)
        req.output_token_ids.append(first_token)
        if first_logprob is not None and req.params.logprobs is not None:
            req.logprobs.append(first_logprob)
        req.num_emitted += 1
        if req.detok is not None:
            req.full_text += req.detok.add(first_token)
        req.text_checked = len(req.full_text)
        req.num_text_sent = streamable_len(req)  # what the producer streamed for token 0
        req.move(RequestState.DECODING)

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Tests and benches: blocks for a prompt's KV outside the scheduler (workers use
        add_remote), or None while the pool cannot hold it."""
        n = self.blocks.blocks_for(num_tokens)
        return self.blocks.allocate(n) if self.blocks.can_allocate(n) else None

    def unreserve(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, block_ids: list[int], first_token: int,
                      first_logprob: LogprobRow | None = None,
                      prior_output_ids: list[int] | None = None) -> Request:
        """Tests and benches: add_remote and kv_landed in one call, into blocks from
        reserve() (the request owns them from here on). A migrated request: the KV covers
        prompt + prior_output_ids, and first_token is the one sampled after them."""
        req = self._new_request(request_id, prompt_token_ids, params, RequestState.RESERVING,
                                prior_output_ids)
        req.cache_root = None  # the caller's KV may be anything (benches): never cached
        if len(block_ids) != self.blocks.blocks_for(req.num_tokens):
            raise ValueError(f"block_ids: {len(block_ids)} blocks for a "
                             f"{req.num_tokens}-token prompt")
        req.move(RequestState.WAITING_FOR_KV)
        self._land(req, first_token, first_logprob)
        req.block_ids = list(block_ids)
        self.scheduler.add_running(req)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str,
              state: RequestState = RequestState.FINISHED_ABORTED) -> bool:
        """Ends a request (FINISHED_ABORTED, or FINISHED_ERROR for a failure) and frees its
        own blocks; pinned ones wait for release(). False if the id is unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if not req.finished:
            self._finish(req, state)
        return True

    def pin(self, request_id: str, start: int, stop: int) -> list[int]:
        """Producer: the ids of the request's blocks [start, stop), which a transfer is about
        to read; they stay allocated (through preemption and abort) until release()."""
        req = self.requests[request_id]
        ids = req.block_ids[start:stop]
        if len(ids) != stop - start:
            raise ValueError(f"pin: blocks [{start}, {stop}) of {request_id!r}, which holds "
                             f"{len(req.block_ids)}")
        self.scheduler.pool(req).share(ids)
        req.pinned.extend(ids)
        return ids

    def release(self, request_id: str) -> None:
        """Frees a request's blocks, pinned ones included, and forgets it: the producer's once
        its transfer is terminal (TRANSFERRING ends here), or any finished one."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if not req.finished and req.state != RequestState.TRANSFERRING:
            self.scheduler.remove(req)
        self._free(req, req.block_ids + req.pinned)
        req.block_ids, req.pinned = [], []

    def state_of(self, request_id: str) -> RequestState | None:
        req = self.requests.get(request_id)
        return None if req is None else req.state

    def held_requests(self) -> list[HeldRequest]:
        """Every request this engine holds, with its state, ages and blocks."""
        now = time.monotonic()
        return [HeldRequest(r.request_id, r.state, now - r.arrival_time, now - r.state_since,
                            len(r.block_ids) + len(r.pinned)) for r in self.requests.values()]

    def num_in(self, *states: RequestState) -> int:
        return sum(1 for r in self.requests.values() if r.state in states)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def block_accounting(self) -> BlockAccounting:
        return self.scheduler.accounting()

    def _free(self, req: Request, block_ids: list[int]) -> None:
        """Frees now, or when the newest launched step that may write them has been read
        (deferred output: a step is launched before the previous one is read, and on a GPU
        a KV transfer into a reused block is not ordered after that step's writes)."""
        last = max((i for i, w in self._unread.items() if req.request_id in w), default=None)
        if last is None:
            self.scheduler.pool(req).free(block_ids)
        else:
            self._free_after.setdefault(last, []).append((self.scheduler.pool(req), block_ids))

    # ---- the step --------------------------------------------------------------------------

    @property
    def has_inflight(self) -> bool:
        """A launched step's ids are unread (deferred output): the device may be busy."""
        return self._inflight is not None

    def step(self) -> StepResult:
        tm = self.timing
        tm.entered_ns = time.time_ns()
        tm.launched_ns = tm.read_launched_ns = tm.read_ns = 0
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        launched: InflightStep | None = None
        written: torch.cuda.Event | None = None
        if sched.chunks:
            self._step_id += 1
            samplers, out = self._execute(sched.chunks)
            if self.device.type == "cuda" and not self.defers_output:  # a producer's pushes
                written = torch.cuda.Event()
                written.record()
            self.scheduler.commit(sched)
            if self.trace:
                self.trace("launch", self._step_id)
            index = []
            for r in samplers:
                index.append(len(r.output_token_ids))
                r.output_token_ids.append(PLACEHOLDER)
            launched = InflightStep(self._step_id, samplers, index, out, time.time_ns())
            tm.launched_ns = launched.launched_ns
            self._unread[self._step_id] = {c.request.request_id: (c.request, c.start + c.num_tokens)
                                           for c in sched.chunks}
        if not self.defers_output:
            if launched is not None and self.device_wait is not None:
                while not launched.out.ready():
                    self.device_wait(launched.out.left_s())
            outputs = self._process(launched) if launched else []
            if outputs and self.on_read is not None:
                self.on_read(outputs)
        else:
            outputs = self._process(self._inflight) if self._inflight else []
            self._inflight = launched
        return self._result(outputs, sched, written)

    def _execute(self, chunks: list[ScheduledChunk]) -> tuple[list[Request], SamplerOutput]:
        if self.between_launches is None:
            return self.runner.execute(chunks, self._inflight)
        # whose launch calls between_layers: the model's forward, or a simulated engine's
        launcher = self.runner if isinstance(self.runner, SimRunner) else self.runner.model
        launcher.between_layers = self.between_launches
        try:
            return self.runner.execute(chunks, self._inflight)
        finally:
            launcher.between_layers = None

    def _result(self, outputs: list[RequestOutput], sched: SchedulerOutput,
                kv_written: object | None = None) -> StepResult:
        res = StepResult(outputs, kv_written=kv_written)
        res.reserved = {r.request_id: list(r.block_ids) for r in sched.reserved}
        res.reserved_cached = {r.request_id: r.num_registered_blocks for r in sched.reserved
                               if r.num_registered_blocks}
        bs = self.config.block_size
        reqs = [c.request for c in sched.chunks] + sched.preempted
        if self.defers_output and self.config.prefills_only:
            # a producer made to defer (benchmarks) reads token 0 a step after the chunk
            # that sampled it: only then are all its blocks final (the partial last one too),
            # and the request is in no chunk of the step that reads it
            reqs += [r for o in outputs if (r := self.requests.get(o.request_id)) is not None]
        for r in reqs:
            if r.prefill_only and not r.finished:
                res.final_blocks[r.request_id] = (
                    len(r.block_ids) if r.state == RequestState.TRANSFERRING
                    else r.num_computed_tokens // bs)
        res.finished = [o.request_id for o in outputs if o.finished]
        return res

    def _process(self, step: InflightStep) -> list[RequestOutput]:
        ids = step.out.token_ids.tolist()  # the host sync: the step has completed
        self.timing.read_ns = time.time_ns()
        self.timing.read_launched_ns = step.launched_ns
        for r, written in self._unread.pop(step.step_id, {}).values():
            self.scheduler.cache_written(r, written)  # ids read: the step has completed
        for pool, freed in self._free_after.pop(step.step_id, []):
            pool.free(freed)
        # When the sampling forward had run: read back now (direct), or at its launch when
        # a later step reads it (deferred; exact on CPU, the launch time on a GPU).
        sampled_ns = time.time_ns() if step is not self._inflight else step.launched_ns
        if self.trace:
            self.trace("read", step.step_id)
        lps = logprob_rows(step.out)
        outputs = []
        for row, r in enumerate(step.requests):
            if r.finished:  # stopped or aborted after this step was launched: drop the token
                continue
            i = step.out_index[row]
            r.output_token_ids[i] = ids[row]
            if lps is not None and r.params.logprobs is not None:
                tl = lps[row]
                r.logprobs.append(LogprobRow(tl.token_id, tl.logprob,
                                             tl.top[: r.params.logprobs]))
            outputs.append(self._update(r, i, step.step_id, sampled_ns))
        return outputs

    def _update(self, r: Request, i: int, sampled_step: int, sampled_ns: int) -> RequestOutput:
        """Stop checks for r's output token i; returns what to report."""
        tok = r.output_token_ids[i]
        if r.detok is not None:
            r.full_text += r.detok.add(tok)
        state, stop_reason, cut = check_stop(r, i, tok, self.eos_token_ids, self.max_model_len)
        r.text_checked = len(r.full_text)
        if cut is not None:
            r.full_text = r.full_text[:cut]
        if state is not None:
            if r.detok is not None and cut is None:
                r.full_text += r.detok.flush()  # bytes held for a character never completed
            del r.output_token_ids[i + 1:]  # placeholders sampled past the stop
            del r.logprobs[i + 1:]
            self._finish(r, state)
        elif r.prefill_only:
            # Producer: token 0 is out; blocks stay until the consumer acknowledges the KV.
            self.scheduler.remove(r)
            r.move(RequestState.TRANSFERRING)
        new = r.output_token_ids[r.num_emitted:i + 1]
        new_lps = r.logprobs[r.num_emitted:i + 1]
        r.num_emitted = i + 1
        upto = len(r.full_text) if r.finished else streamable_len(r)
        text = r.full_text[r.num_text_sent:upto]
        r.num_text_sent = upto
        return RequestOutput(
            request_id=r.request_id, new_token_ids=new, new_text=text, state=r.state,
            finish_reason=r.state.finish_reason, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=i + 1, sampled_step=sampled_step, emitted_step=self._step_id,
            sampled_ns=sampled_ns,
            new_logprobs=new_lps, stop_reason=stop_reason, seed=r.seed,
            num_cached_tokens=r.num_cached_tokens or 0)

    def _finish(self, r: Request, state: RequestState) -> None:
        self.scheduler.remove(r)
        r.move(state)
        self._free(r, r.block_ids)
        r.block_ids = []
        if not r.pinned:  # else a transfer may still read them: kept until release()
            self.requests.pop(r.request_id, None)
