"""The engine loop: schedule -> execute -> update, in direct or deferred output mode.

Deferred (consumer, colocated): step N+1 is launched before step N's sampled ids are read;
N's stop checks and streaming happen after, and a token sampled past a stop is dropped.
Direct (producer): a step's sampled ids are read and reported by that same step, so token 0
never waits behind another request's prefill chunk (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine import host_memory
from engine.block_manager import BlockAccounting, BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.kv_layout import KVLayout
from engine.model_runner import InflightStep, ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.outputs import RequestOutput
from engine.request import PLACEHOLDER, LogprobRow, Request
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stop_check import check_stop, streamable_len

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

TraceHook = Callable[[str, int], None]


class LLMEngine:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: LlamaForCausalLM,
                 tokenizer: Tokenizer | None, model_name: str) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        self.max_model_len = _max_model_len(config, model_cfg)
        self.layout = KVLayout(
            model=model_name, dtype=config.dtype, block_size=config.block_size,
            num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim, num_blocks=1)
        # Never more than every seat filled to max_model_len could use.
        cap = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        kv_bytes = config.kv_cache_bytes
        if config.gpu_memory_utilization is not None:
            from engine.memory_budget import kv_bytes_for_utilization

            kv_bytes = kv_bytes_for_utilization(config, model_cfg, self.device)
        num_blocks = config.num_kv_blocks or max(1, min(cap, kv_bytes
                                                        // self.layout.block_nbytes))
        self.layout = dataclasses.replace(self.layout, num_blocks=num_blocks)
        # A sequence can never outgrow the pool: advertise what really fits.
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        dtype = getattr(torch, config.dtype)
        shape = (num_blocks, *self.layout.block_shape)
        # on CPU, huge pages: a transfer between processes pins every page it moves
        self.kv_cache = (host_memory.zeros(shape, dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=dtype, device=self.device))
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_waiting,
                                   self.max_model_len)
        eos = set(model_cfg.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self.runner = ModelRunner(model, self.kv_cache, config.block_size, self.eos_token_ids,
                                  self.device, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  cuda_graphs=not config.enforce_eager)
        self.requests: dict[str, Request] = {}
        self._inflight: InflightStep | None = None
        self._step_id = 0
        self._seed_rng = random.Random(config.seed)
        self.num_preemptions = 0  # requests whose KV was dropped to be recomputed
        self.trace: TraceHook | None = None  # ("launch" | "read", step id), for tests/metrics

    @property
    def defers_output(self) -> bool:
        return self.config.defers_output

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.model_cfg.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.model_cfg.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens, max_model_len is "
                             f"{self.max_model_len} (room for one output token needed)")
        params.validate()
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_token_ids)}) + max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})")
        need = self.blocks.blocks_for(len(prompt_token_ids) + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"max_tokens: prompt + max_tokens needs {need} KV blocks, the pool has "
                f"{self.blocks.num_blocks}")

    def validate_prior(self, prompt_token_ids: list[int], params: SamplingParams,
                       prior_output_ids: list[int]) -> None:
        """Checks the output tokens a migrated request resumes after."""
        if any(not 0 <= t < self.model_cfg.vocab_size for t in prior_output_ids):
            raise ValueError(f"prior_output_ids: token ids must be in "
                             f"[0, {self.model_cfg.vocab_size})")
        if len(prior_output_ids) >= params.max_tokens:
            raise ValueError(f"prior_output_ids: {len(prior_output_ids)} tokens, max_tokens "
                             f"is {params.max_tokens} (nothing left to generate)")
        if len(prompt_token_ids) + len(prior_output_ids) >= self.max_model_len:
            raise ValueError(f"prior_output_ids: prompt + {len(prior_output_ids)} prior "
                             f"tokens reach max_model_len ({self.max_model_len})")

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, prior_output_ids: list[int] | None = None
                     ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        prior = list(prior_output_ids or ())
        if prior:
            self.validate_prior(prompt_token_ids, params, prior)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(request_id, list(prompt_token_ids), params, seed,
                      prefill_only=self.config.role == "producer")
        if self.tokenizer is not None:
            from engine.detokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens)
        if prior:
            _resume_after(req, prior)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prior_output_ids: list[int] | None = None
                    ) -> Request:
        """Queues a request; ValueError names a bad field, QueueFull means retry later.

        prior_output_ids: a migrated request's tokens its client already has; they are
        prefilled with the prompt and generation goes on after them as if it never stopped
        (same positions, penalties, min/max_tokens and stop state)."""
        req = self._new_request(request_id, prompt_token_ids, params, prior_output_ids)
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Consumer: blocks for a prompt's KV, or None while the pool cannot hold it."""
        n = self.blocks.blocks_for(num_tokens)
        return self.blocks.allocate(n) if self.blocks.can_allocate(n) else None

    def unreserve(self, block_ids: list[int]) -> None:
        self.blocks.free(block_ids)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, block_ids: list[int], first_token: int,
                      first_logprob: LogprobRow | None = None,
                      prior_output_ids: list[int] | None = None) -> Request:
        """Consumer: admits a request whose prompt KV already sits in `block_ids` and whose
        token 0 was sampled (and reported) by the producer; decoding continues from there
        exactly as a colocated engine would (same seed, same positions, same stop state).
        With logprobs requested, token 0's row is needed: rows are kept by output position.
        A migrated request: the KV covers prompt + prior_output_ids, and first_token is the
        one sampled after them."""
        if params.logprobs is not None and first_logprob is None:
            raise ValueError("first_logprob: token 0's logprobs are required when the request "
                             "asks for logprobs")
        req = self._new_request(request_id, prompt_token_ids, params, prior_output_ids)
        if len(block_ids) != self.blocks.blocks_for(req.num_tokens):
            raise ValueError(f"block_ids: {len(block_ids)} blocks for a "
                             f"{req.num_tokens}-token prompt")
        req.block_ids = list(block_ids)
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(first_token)
        if first_logprob is not None and params.logprobs is not None:
            req.logprobs.append(first_logprob)
        req.num_emitted += 1
        if req.detok is not None:
            req.full_text += req.detok.add(first_token)
        req.text_checked = len(req.full_text)
        req.num_text_sent = streamable_len(req)  # what the producer streamed for token 0
        req.state = RequestState.DECODING
        self.scheduler.add_running(req)
        self.requests[request_id] = req
        return req

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        if not req.finished:
            self._finish(req, RequestState.FINISHED_ABORTED)
        else:
            self.release(request_id)
        return True

    def stop(self, request_id: str) -> None:
        """Stops computing a request but keeps its blocks (a transfer may still read them)
        until release()."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.remove(req)
            req.state = RequestState.FINISHED_ABORTED

    def release(self, request_id: str) -> None:
        """Frees a finished (or transferred) request's blocks and forgets it."""
        req = self.requests.pop(request_id, None)
        if req is not None and req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def block_accounting(self) -> BlockAccounting:
        return self.blocks.accounting()

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        launched: InflightStep | None = None
        if sched.chunks:
            self._step_id += 1
            samplers, out = self.runner.execute(sched.chunks, self._inflight)
            self.scheduler.commit(sched)
            if self.trace:
                self.trace("launch", self._step_id)
            index = []
            for r in samplers:
                index.append(len(r.output_token_ids))
                r.output_token_ids.append(PLACEHOLDER)
            launched = InflightStep(self._step_id, samplers, index, out, time.time_ns())
        if not self.defers_output:
            return self._process(launched) if launched else []
        outputs = self._process(self._inflight) if self._inflight else []
        self._inflight = launched
        return outputs

    def _process(self, step: InflightStep) -> list[RequestOutput]:
        ids = step.out.token_ids.tolist()  # the host sync
        # When the sampling forward had run: read back now (direct), or at its launch when
        # a later step reads it (deferred; exact on CPU, the launch time on a GPU).
        sampled_ns = time.time_ns() if step is not self._inflight else step.launched_ns
        if self.trace:
            self.trace("read", step.step_id)
        lps = _logprob_rows(step)
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
            r.state = RequestState.TRANSFERRING
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
            new_logprobs=new_lps, stop_reason=stop_reason)

    def _finish(self, r: Request, state: RequestState) -> None:
        self.scheduler.remove(r)
        r.state = state
        if r.block_ids:
            self.blocks.free(r.block_ids)
            r.block_ids = []
        self.requests.pop(r.request_id, None)


def _resume_after(req: Request, prior: list[int]) -> None:
    """Makes req look as it did after emitting ``prior``: their text was already sent (as
    much as was streamable), their logprob rows too (kept by position, so stand-ins)."""
    req.output_token_ids.extend(prior)
    req.num_prior_outputs = req.num_emitted = len(prior)
    if req.params.logprobs is not None:
        req.logprobs.extend(LogprobRow(t, 0.0) for t in prior)
    if req.detok is not None:
        req.full_text = "".join(req.detok.add(t) for t in prior)
    req.text_checked = len(req.full_text)
    req.num_text_sent = streamable_len(req)


def _logprob_rows(step: InflightStep) -> list[LogprobRow] | None:
    out = step.out
    if out.logprobs is None:
        return None
    lp = out.logprobs.tolist()
    ids = out.token_ids.tolist()
    if out.top_ids is None or out.top_logprobs is None:
        return [LogprobRow(t, v) for t, v in zip(ids, lp, strict=True)]
    tops = [tuple(zip(a, b, strict=True)) for a, b in zip(out.top_ids.tolist(),
                                                         out.top_logprobs.tolist(), strict=True)]
    return [LogprobRow(t, v, top) for t, v, top in zip(ids, lp, tops, strict=True)]


def _max_model_len(config: EngineConfig, m: ModelConfig) -> int:
    limit = m.max_position_embeddings
    if m.sliding_window:
        limit = min(limit, m.sliding_window)  # no sliding-window attention: stay inside it
    if config.max_model_len is None:
        return min(limit, 8192)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's limit "
                         f"({limit})")
    return config.max_model_len
