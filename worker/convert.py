"""Conversions between protobuf messages and the engine-process wire dicts."""

from __future__ import annotations

from typing import Any

from pdserve.v1 import common_pb2, worker_pb2

from engine.request import LogprobRow
from worker.messages import TokensEvent

_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "": common_pb2.FINISH_REASON_UNSPECIFIED,
           "stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ERROR}

# Proto fields copied as they are; the optional ones only when the client set them, so the
# engine's defaults apply otherwise.
_PLAIN = ("min_tokens", "top_k", "min_p", "frequency_penalty", "presence_penalty",
          "ignore_eos", "include_stop_str_in_output")
_OPTIONAL = ("max_tokens", "temperature", "top_p", "repetition_penalty", "logprobs",
             "skip_special_tokens")


def finish_reason_pb(name: str | None) -> int:
    return _FINISH[name]


def sampling_to_wire(p: common_pb2.SamplingParams, seed: int) -> dict[str, Any]:
    d: dict[str, Any] = {f: getattr(p, f) for f in _PLAIN}
    for f in _OPTIONAL:
        if p.HasField(f):
            d[f] = getattr(p, f)
    for f in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
              "presence_penalty"):
        if f in d:  # float32 on the wire: round to what the client most likely meant
            d[f] = float(f"{d[f]:.6g}")
    d["stop"] = list(p.stop)
    d["stop_token_ids"] = list(p.stop_token_ids)
    d["seed"] = int(seed)
    return d


def token_logprob(row: LogprobRow) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=row.token_id, logprob=row.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in row.top])


def tokens_pb(ev: TokensEvent) -> worker_pb2.Tokens:
    return worker_pb2.Tokens(
        token_ids=ev.ids, text=ev.text, logprobs=[token_logprob(r) for r in ev.logprobs],
        finish_reason=_FINISH[ev.finish], stop_reason=ev.stop_reason, error=ev.error,
        kv_ready_ns=ev.kv_ready_ns, first_step_ns=ev.first_step_ns)
