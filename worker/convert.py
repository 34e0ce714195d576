"""Conversions between protobuf messages and the engine-process wire dicts, and the checks
a request must pass at a worker's gRPC door before its engine sees it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.v1 import common_pb2, worker_pb2

from engine.request import LogprobRow
from engine.request_limits import check_ids, check_lengths, check_request_id
from engine.sampling_fields import SEED_LIMIT, wire_values
from engine.sampling_params import SamplingParams
from worker.messages import Token0Event
from worker.token_batch import TokensEvent

_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "": common_pb2.FINISH_REASON_UNSPECIFIED,
           "stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ERROR}


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the engine's model (from its ready report)."""

    vocab_size: int
    max_model_len: int


def finish_reason_pb(name: str | None) -> int:
    return _FINISH[name]


def sampling_to_wire(p: common_pb2.SamplingParams, seed: int) -> dict[str, Any]:
    """The engine's values (the same table and float32 rounding the router validated with),
    with the request's resolved seed."""
    d = wire_values(p)
    d["seed"] = int(seed)
    return d


def checked_request(rid: str, prompt_ids: Sequence[int], p: common_pb2.SamplingParams,
                    seed: int, limits: ModelLimits,
                    prior_ids: Sequence[int] = ()) -> SamplingParams:
    """The engine's sampling parameters for a Prefill/Decode request, after every check the
    engine relies on; ValueError("<field>: ...") names the wire field at fault. The same checks as
    the router's (engine.sampling_fields, engine.request_limits): the worker's gRPC takes
    calls from anyone holding the cluster token, not only the router."""
    if not rid:
        raise ValueError("request_id: required")
    check_request_id(rid)
    if not prompt_ids:
        raise ValueError("prompt_token_ids: must not be empty")
    check_ids(prompt_ids, limits.vocab_size, "prompt_token_ids")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed: must be an integer in [0, 2**63), got {seed}")
    d = sampling_to_wire(p, seed)
    try:
        params = SamplingParams(**d)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e
    check_ids(params.stop_token_ids, limits.vocab_size, "sampling.stop_token_ids")
    if params.logprobs is not None and params.logprobs > limits.vocab_size:
        raise ValueError(f"sampling.logprobs: at most the vocabulary size "
                         f"({limits.vocab_size}), got {params.logprobs}")
    check_lengths(len(prompt_ids), params.max_tokens, limits.max_model_len,
                  prompt_field="prompt_token_ids", max_tokens_field="sampling.max_tokens")
    # a migrated request's tokens already streamed: output tokens, inside max_tokens
    check_ids(prior_ids, limits.vocab_size, "prior_output_ids")
    if len(prior_ids) >= params.max_tokens:
        raise ValueError(f"prior_output_ids: {len(prior_ids)} tokens leave nothing of "
                         f"sampling.max_tokens ({params.max_tokens}) to generate")
    return params


def token_logprob(row: LogprobRow) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=row.token_id, logprob=row.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in row.top])


def fill_token0(t0: worker_pb2.Token0, ev: Token0Event, sent_ns: int) -> worker_pb2.Token0:
    """A producer's token 0 into ``t0`` (a new message, or a new entry of an OutputBatch's
    token0s); ``sent_ns``: when it is handed to the router's stream."""
    t0.token_id = ev.token_id
    if ev.text:
        t0.text = ev.text
    if ev.logprob is not None:
        t0.logprob.CopyFrom(token_logprob(ev.logprob))
    if ev.finish:
        t0.finish_reason = _FINISH[ev.finish]
    if ev.stop_reason:
        t0.stop_reason = ev.stop_reason
    t0.sampled_ns = ev.sampled_ns
    t0.received_ns = ev.received_ns
    t0.sent_ns = sent_ns
    t0.emitted_ns = ev.emitted_ns
    if ev.cached_tokens:
        t0.cached_tokens = ev.cached_tokens
    return t0


def add_tokens(into: Any, ev: TokensEvent) -> worker_pb2.Tokens:
    """``tokens_pb(ev)`` with its request id, built in place as a new entry of ``into`` (a
    repeated Tokens field): once per token per step on the Outputs stream, so only the
    fields that are set are passed."""
    t: worker_pb2.Tokens = into.add(request_id=ev.rid, token_ids=ev.ids, text=ev.text)
    if ev.logprobs:
        t.logprobs.extend([token_logprob(r) for r in ev.logprobs])
    if ev.finish:
        t.finish_reason = _FINISH[ev.finish]
    if ev.stop_reason:
        t.stop_reason = ev.stop_reason
    if ev.error:
        t.error = ev.error
    if ev.kv_ready_ns:  # the handoff's other stamps come with it (0s serialize as nothing)
        t.kv_ready_ns = ev.kv_ready_ns
        t.notice_sent_ns = ev.notice_sent_ns
        t.notice_seen_ns = ev.notice_seen_ns
        t.kv_done_ns = ev.kv_done_ns
    if ev.first_step_ns:
        t.first_step_ns = ev.first_step_ns
    if ev.cached_tokens:
        t.cached_tokens = ev.cached_tokens
    return t


def tokens_pb(ev: TokensEvent) -> worker_pb2.Tokens:
    return worker_pb2.Tokens(
        token_ids=ev.ids, text=ev.text, logprobs=[token_logprob(r) for r in ev.logprobs],
        finish_reason=_FINISH[ev.finish], stop_reason=ev.stop_reason, error=ev.error,
        kv_ready_ns=ev.kv_ready_ns, first_step_ns=ev.first_step_ns,
        cached_tokens=ev.cached_tokens, notice_sent_ns=ev.notice_sent_ns,
        notice_seen_ns=ev.notice_seen_ns, kv_done_ns=ev.kv_done_ns)
