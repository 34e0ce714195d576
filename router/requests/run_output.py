"""What the client of one request receives: its responses, token count and server timing.

Kept apart from the run's lifecycle (``router.requests.request_run``) so that the run decides *when*
a request moves or ends, and this decides only *what* each message then carries.
"""

from __future__ import annotations

import logging
import time

from pdserve.v1 import common_pb2, router_pb2, worker_pb2

from router.control.registry import WorkerInfo
from router.requests.validation import PreparedRequest

log = logging.getLogger(__name__)

FINISH_ERROR = common_pb2.FINISH_REASON_ERROR
FINISH_ABORT = common_pb2.FINISH_REASON_ABORT


class RunOutput:
    def __init__(self, prep: PreparedRequest, received_ns: int) -> None:
        self.prep = prep
        self.timing = router_pb2.ServerTiming(router_received_ns=received_ns)
        self.completion_tokens = 0  # tokens handed to the client so far
        # ... and their ids: a migrated request resumes after them (prior_output_ids)
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # prompt tokens the prefill found in a prefix cache
        self._stamps_open = True  # the consumer's timing stamps may still come

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    def token0(self, t0: worker_pb2.Token0, read_ns: int = 0) -> router_pb2.GenerateResponse:
        """Token 0 from the producer, which the router read at ``read_ns``; the caller
        finishes it when ``t0.finish_reason``."""
        resp = router_pb2.GenerateResponse(request_id=self.request_id,
                                           token_ids=[t0.token_id], text=t0.text)
        if t0.HasField("logprob"):
            resp.logprobs.append(t0.logprob)
        if not self.completion_tokens:  # a migrated request's "token 0" is not its first
            self.cached_tokens = t0.cached_tokens
            self.timing.producer_received_ns = t0.received_ns
            self.timing.producer_token0_sampled_ns = t0.sampled_ns
            self.timing.producer_token0_emitted_ns = t0.emitted_ns
            self.timing.producer_token0_sent_ns = t0.sent_ns
            self.timing.producer_token0_taken_ns = t0.taken_ns
            self.timing.router_token0_read_ns = read_ns
            self.timing.router_token0_sent_ns = time.time_ns()
        self.completion_tokens += 1
        self.token_ids.append(t0.token_id)
        return resp

    def more(self, tokens: worker_pb2.Tokens) -> tuple[router_pb2.GenerateResponse, int]:
        """A decoding leg's tokens as the client's response, and how many they are; the
        finish, if any, is the caller's (``tokens``).

        Per token on the hot path: the ids as one list (a slice of the repeated field: one
        C call, where extending a list from the field iterates it), used for the response
        and the record of what the client has; an empty repeated field is not passed
        (copying even an empty container costs more than the message's other fields)."""
        ids = tokens.token_ids[:]
        lp = tokens.logprobs
        if lp:
            resp = router_pb2.GenerateResponse(request_id=self.prep.request_id, token_ids=ids,
                                               text=tokens.text, logprobs=lp)
        else:
            resp = router_pb2.GenerateResponse(request_id=self.prep.request_id, token_ids=ids,
                                               text=tokens.text)
        self.completion_tokens += len(ids)
        self.token_ids += ids
        if self._stamps_open:
            self._stamp(tokens)
        return resp, len(ids)

    def tokens(self, tokens: worker_pb2.Tokens, w: WorkerInfo
               ) -> tuple[router_pb2.GenerateResponse, str | None]:
        """A decoding leg's tokens; the error is None while the request goes on, "" when
        it finished well, else what failed."""
        if not self.completion_tokens and tokens.cached_tokens:  # colocated: its prefill
            self.cached_tokens = tokens.cached_tokens
        resp = self.more(tokens)[0]
        if not tokens.finish_reason:
            return resp, None
        error = ""
        if tokens.finish_reason == FINISH_ERROR:
            error = f"{w.role_name} {w.worker_id}: {tokens.error or 'no details'}"
            log.warning("request %s failed: %s", self.request_id, error)
        return self.final(resp, tokens.finish_reason, tokens.stop_reason, error), error

    def _stamp(self, tokens: worker_pb2.Tokens) -> None:
        t = self.timing
        if tokens.kv_ready_ns and not t.consumer_kv_ready_ns:
            t.consumer_kv_ready_ns = tokens.kv_ready_ns
            # the stamps before it come with it (a P/D consumer's; 0 where unknown)
            t.producer_notice_sent_ns = tokens.notice_sent_ns
            t.consumer_notice_seen_ns = tokens.notice_seen_ns
            t.consumer_kv_done_ns = tokens.kv_done_ns
        if tokens.first_step_ns and not t.consumer_first_step_ns:
            t.consumer_first_step_ns = tokens.first_step_ns
        # the consumer sends both with its first step's tokens; once set, they stay
        self._stamps_open = not t.consumer_first_step_ns

    def aborted(self) -> router_pb2.GenerateResponse:
        return self.final(router_pb2.GenerateResponse(request_id=self.request_id),
                          FINISH_ABORT)

    def failed(self, message: str) -> router_pb2.GenerateResponse:
        log.warning("request %s failed: %s", self.request_id, message)
        return self.final(router_pb2.GenerateResponse(request_id=self.request_id),
                          FINISH_ERROR, error=message)

    def final(self, resp: router_pb2.GenerateResponse, finish: int, stop_reason: str = "",
              error: str = "") -> router_pb2.GenerateResponse:
        resp.finish_reason = finish  # type: ignore[assignment]
        resp.stop_reason = stop_reason
        resp.error = error
        resp.usage.prompt_tokens = len(self.prep.prompt_token_ids)
        resp.usage.completion_tokens = self.completion_tokens
        resp.usage.cached_tokens = self.cached_tokens
        self.timing.router_finished_ns = time.time_ns()
        resp.timing.CopyFrom(self.timing)
        return resp
